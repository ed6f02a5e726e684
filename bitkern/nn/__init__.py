"""torch.nn modules: Linear, Conv2d, quantize_model, safetensors save/load (not built yet)."""
