"""hydra/sweeper=kiln_optuna: the class Hydra instantiates. Hydra's plugin scan imports this
module at every start-up (config errors and --help included), so it imports nothing heavy:
optuna and the search loop live in `_study`, which the scan skips, and load when a search starts."""

from __future__ import annotations

from typing import Any

from hydra_plugins.hydra_optuna_sweeper.optuna_sweeper import OptunaSweeper


class KilnOptunaSweeper(OptunaSweeper):
    def __init__(self, heartbeat_interval: int, grace_period: int | None, **stock: Any) -> None:
        super().__init__(**stock)
        self.heartbeat_interval = heartbeat_interval
        self.grace_period = grace_period

    def sweep(self, arguments: list[str]) -> None:
        from hydra_plugins.kiln_optuna_sweeper._study import run_search

        run_search(self, arguments)
