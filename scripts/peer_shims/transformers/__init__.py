"""Stand-in for `transformers` (see ../README.md): the names mlx-lm imports, unusable."""


class _Absent:
    def __init__(self, *a, **k):
        raise RuntimeError("transformers is not installed here (a benchmark stand-in was imported)")

    @classmethod
    def from_pretrained(cls, *a, **k):
        cls()


class AutoTokenizer(_Absent):
    @classmethod
    def register(cls, *a, **k):  # mlx-lm registers its own tokenizer class at import
        pass


class AutoConfig(_Absent):
    pass


class PreTrainedTokenizer(_Absent):
    pass


class PreTrainedTokenizerFast(_Absent):
    pass
