"""m3serve: a serving stack for MiniMax-M3.

`from m3serve import LLM, SamplingParams` is the offline API (imported lazily so that light
users of the package, such as the benchmark client, do not pay for torch).
"""
__all__ = ["LLM", "SamplingParams"]


def __getattr__(name):
    if name == "LLM":
        from m3serve.llm import LLM
        return LLM
    if name == "SamplingParams":
        from m3serve.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(name)
