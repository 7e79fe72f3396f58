"""Train a model: `python train.py [group=option ...] [key=value ...]`. See README.md."""

from kiln.cli.script import run_script
from kiln.cli.train import main

if __name__ == "__main__":
    run_script(main)
