"""Predict, export and serve from a checkpoint: `python infer.py ckpt=... input=...`. See README."""

from kiln.cli.infer import main

if __name__ == "__main__":
    main()
