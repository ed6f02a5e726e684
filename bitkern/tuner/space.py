"""Roller-style candidate enumeration through the templates' protocol: every template of the device's target that
can serve the kernel contributes its configurations, grown from the device hint while they fit each level's
capacity (`Template.configs`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..codegen import templates
from ..ops.matmul import Matmul
from .hints import Hint, device_hint


@dataclass(frozen=True)
class Candidate:
    """One template configuration the tuner may build."""

    template: str
    config: object


def usable_templates(spec: Matmul, n: int, k: int, bucket: tuple[int, int], layout, device) -> tuple[list, dict]:
    """(the templates of the device's target that can serve this kernel, {name: why not} for the others)."""
    usable, unused = [], {}
    for template in templates(device.kind):
        reason = template.missing_features(device) or template.unsupported_grouping(spec) or \
            template.unsupported(spec, n, k, device) or template.unsupported_epilogue(spec)
        if reason is None and layout not in template.layouts:
            reason = f"the {layout} weight layout"
        if reason is None:
            reason = template.unsupported_rows(bucket, device)
        if reason is None:
            usable.append(template)
        else:
            unused[template.name] = reason
    return usable, unused


def enumerate_candidates(spec: Matmul, n: int, k: int, bucket: tuple[int, int], layout,
                         device) -> tuple[Hint, list[Candidate]]:
    """The device hint and every configuration, of every template that can serve the kernel."""
    hint = device_hint(spec, k, device)
    usable, _ = usable_templates(spec, n, k, bucket, layout, device)
    return hint, [Candidate(template.name, config) for template in usable
                  for config in template.configs(spec, n, k, bucket, device, hint)]
