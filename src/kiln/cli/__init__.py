"""Entry points: compose the config, hand over, exit with a meaningful code."""
