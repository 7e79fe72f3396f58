"""hydra/sweeper=kiln_optuna: the stock Optuna sweeper's keys plus the heartbeat settings."""

# No `from __future__ import annotations`: Hydra's plugin scan imports this module without
# registering it in sys.modules, where dataclasses would look the string annotations up.
from dataclasses import dataclass

from hydra.core.config_store import ConfigStore
from hydra_plugins.hydra_optuna_sweeper.config import OptunaSweeperConf


@dataclass
class KilnOptunaSweeperConf(OptunaSweeperConf):
    """n_trials is the size of the whole study, over every worker and every resume."""

    _target_: str = "hydra_plugins.kiln_optuna_sweeper.sweeper.KilnOptunaSweeper"
    # With a database storage each running trial sends a heartbeat every heartbeat_interval
    # seconds; one silent for grace_period seconds (null: twice the interval) was interrupted
    # (its worker was killed) and is queued again with the same parameters.
    heartbeat_interval: int = 60
    grace_period: int | None = None


ConfigStore.instance().store(
    group="hydra/sweeper", name="kiln_optuna", node=KilnOptunaSweeperConf, provider="kiln"
)
