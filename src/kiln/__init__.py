"""kiln: a Hydra-configured PyTorch experiment monorepo."""

__version__ = "0.1.0"
