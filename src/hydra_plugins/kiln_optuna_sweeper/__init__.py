"""kiln's Optuna sweeper (hydra/sweeper=kiln_optuna): hydra-optuna-sweeper's search, on a study
that several workers share and that a killed search resumes. Hydra finds plugins only under the
hydra_plugins namespace package, hence this folder beside src/kiln."""
