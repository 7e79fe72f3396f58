"""Train a model: `python train.py [group=option ...] [key=value ...]`. See README.md."""

from kiln.cli.script import run_script, stop_signals

if __name__ == "__main__":
    with stop_signals():  # from before the imports: a preemption during them is one line too
        from kiln.cli.train import main

        run_script(main, collect_during_imports=False)  # until torch and the engine are in
