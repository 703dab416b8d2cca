"""A generation request: its options as typed objects (`keywords`: the API's flat keywords mapped
onto `SpecConfig` and `SamplerConfig`)."""
from .keywords import sampler_config, spec_config

__all__ = ["sampler_config", "spec_config"]
