"""Hydra finds the option YAMLs that kiln plugins ship: every folder a plugin registered with
`kiln.registry.register_config_dir` joins the config search path, after kiln's own conf/ and
before hydra.searchpath, for `train.py`, `--help` and kiln's own composition alike. Hydra
imports this module in its plugin scan, so it stays torch-free."""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

from kiln.registry import config_dirs


class KilnPluginConfigs(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        for entry in config_dirs():
            search_path.append(provider="kiln-plugin", path=entry)
