"""Data readers: every reader yields torchrec ``Batch``es and has an exact, JSON
state (see ``reader.Reader``)."""

from trainer.data.criteo import CriteoTsvReader, MalformedLineError
from trainer.data.reader import Reader
from trainer.data.synthetic import SyntheticClickStream

__all__ = ["CriteoTsvReader", "MalformedLineError", "Reader", "SyntheticClickStream"]
