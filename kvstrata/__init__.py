"""kvstrata: layer-wise KV-cache loading for LLM inference engines.

``kvstrata.core`` holds the server, protocol, store, planner and the arrival
machinery; ``kvstrata.native`` the copy executors; ``kvstrata.adapters`` the
engine adapters. See docs/architecture.md.
"""

__version__ = "0.1.0"
