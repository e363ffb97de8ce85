"""Files: saved traces (``log.save`` / ``tl.load``) and activations extracted over many inputs
(``tl.extract`` / ``tl.load_extracted``).  Plain data only: JSON metadata and safetensors tensors;
safetensors, tqdm and numpy are imported only by the functions that need them."""

from .extract import ResumeMismatchError, extract
from .extracted import load_extracted
from .format import TraceFileError, UnsafeMemberError
from .load import load
from .save import save

__all__ = ["save", "load", "extract", "load_extracted", "TraceFileError", "UnsafeMemberError", "ResumeMismatchError"]
