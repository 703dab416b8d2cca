"""A generation request: one typed object (`request.GenerationRequest`) that every front end
builds (`keywords`: from the API's flat keywords), and its preparation for a model (`prepare`:
the prompt rendered and tokenized, the context checked, the decoder made)."""
from .keywords import request_from_keywords, sampler_config, spec_config
from .prepare import Prepared, make_decoder, prepare
from .request import GenerationRequest

__all__ = ["GenerationRequest", "Prepared", "prepare", "make_decoder", "request_from_keywords", "sampler_config",
           "spec_config"]
