"""The decoder's typed errors (importable without torch)."""


class DecoderError(Exception):
    """Base of every error the decoder raises on purpose."""


class ModelLoadError(DecoderError, ValueError):
    """A model could not be found or understood; the message says what to fix."""


class ExactModeUnsupported(DecoderError, RuntimeError):
    """The platform's kernels do not give grouping-independent results (see selfcheck)."""


class CompressorSpecError(DecoderError, ValueError):
    """A compressor spec string that names an unknown method or a bad parameter."""
