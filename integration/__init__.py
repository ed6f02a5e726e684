"""bitkern in the tools people already use: the Hugging Face transformers quantizer, the vLLM quantization
plugin, and importers/exporters for GPTQ, AWQ and bitsandbytes checkpoints.

This folder sits at the top of the repository and installs as `bitkern.integration` (through the link
`bitkern/integration`); nothing below `bitkern.nn` imports it.
"""
