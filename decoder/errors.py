"""The decoder's typed errors (importable without torch)."""


class DecoderError(Exception):
    """Base of every error the decoder raises on purpose."""


class ModelLoadError(DecoderError, ValueError):
    """A model could not be found or understood; the message says what to fix."""


class ExactModeUnsupported(DecoderError, RuntimeError):
    """The platform's kernels do not give grouping-independent results (see selfcheck)."""


class CompressorSpecError(DecoderError, ValueError):
    """A compressor spec string that names an unknown method or a bad parameter."""


class Cancelled(DecoderError):
    """The request was cancelled by its caller."""


class Unreachable(DecoderError):
    """A request's prefix KV can be neither read nor recomputed (maps to UNAVAILABLE)."""


class OverBudget(DecoderError):
    """A request needs more KV bytes than the whole budget: it can never be admitted."""


class ArtifactFormatError(DecoderError, ValueError):
    """Bytes that are not a compressed-KV artifact of this format, or an artifact that does
    not fit the model or prefix it would be used for (maps to DATA_LOSS)."""


class ShuttingDown(DecoderError):
    """The decoder is stopping and did not (or will no longer) serve the call; another
    decoder may (maps to UNAVAILABLE, so clients retry elsewhere)."""
