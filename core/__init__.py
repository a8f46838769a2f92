"""The engine-agnostic core: server, wire protocol, L1 store, planner, arrival gate/board/pool, worker runtime."""
