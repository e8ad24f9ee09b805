"""soap: automatic parallelism for training Hugging Face models.

The public Python API is re-exported lazily so `import soap` stays cheap for the CLI.
"""

__all__ = ["plan", "parallelize", "trace", "tune"]


def __getattr__(name: str):
    if name in __all__:
        from soap import api

        return getattr(api, name)
    raise AttributeError(name)
