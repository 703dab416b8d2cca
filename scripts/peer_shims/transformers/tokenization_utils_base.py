"""Stand-in (see ../README.md)."""
from . import _Absent


class PreTrainedTokenizerBase(_Absent):
    pass
