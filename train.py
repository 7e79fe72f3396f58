"""Train a model: `python train.py [group=option ...] [key=value ...]`. See README.md."""

from kiln.cli.script import run_script

if __name__ == "__main__":
    run_script("kiln.cli.train:main")  # imported once the stop signals are handled
