"""Engine adapters. Each implements the hook specification in ``kvstrata.core.adapter_api.hookspecs``."""
