# Scratch instrumentation (never in the product): wall time of the steps of an engine-placement load's planning.
import os, sys, time, atexit, collections, json, functools
OUT = os.environ.get("KV_STEP_TIMES")
if OUT:
    acc = collections.defaultdict(list)
    def wrap(cls, name, label):
        f = getattr(cls, name)
        @functools.wraps(f)
        def w(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                acc[label].append((time.perf_counter() - t) * 1e6)
        setattr(cls, name, w)
    def patch():
        from kvstrata.core.engine import transfer_queue as tq
        from kvstrata.native import cuda_executor as ce, load_issuer as li
        from kvstrata.core.arrival import gate as g
        from kvstrata.core.transfer import planner as pl
        from kvstrata.core.engine import engine_placement as ep
        wrap(tq.TransferQueue, "_plan", "queue._plan")
        wrap(tq.TransferQueue, "_locate", "queue._locate")
        wrap(tq.TransferQueue, "_enqueue_in_programs", "queue._enqueue_in_programs")
        wrap(ce.CudaLocalCopier, "enqueue_slices", "copier.enqueue_slices")
        wrap(ce.CudaLocalCopier, "mark_slice", "copier.mark_slice")
        wrap(ce.CudaExecutor, "scatter_slices", "executor.scatter_slices")
        wrap(ce.CudaExecutor, "scatter", "executor.scatter")
        wrap(ce.CudaExecutor, "_table", "executor._table")
        wrap(ce.CudaExecutor, "_bind", "executor._bind")
        wrap(ce.CudaTransferEngine, "pool_executor", "engine.pool_executor")
        wrap(li.LoadIssuer, "_submit", "issuer._submit")
        wrap(li.LoadIssuer, "hand_over", "issuer.hand_over")
        wrap(li.IssuedSlice, "__init__", "IssuedSlice.__init__")
        wrap(g.LayerArrivalGate, "record_slice", "gate.record_slice")
        wrap(pl, "plan_copies", "planner.plan_copies")
        wrap(pl.TransferJob, "__init__", "planner.TransferJob")
        wrap(pl, "layer_slices", "planner.layer_slices")
        wrap(ep.EnginePlacement, "submit_retrieve", "placement.submit_retrieve")
    def dump():
        import statistics
        with open(OUT + f".{os.getpid()}.json", "w") as f:
            json.dump({k: {"n": len(v), "median_us": statistics.median(v), "total_us": sum(v)} for k, v in acc.items()}, f, indent=1)
    atexit.register(dump)
    import importlib.abc
    class Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "kvstrata.core.engine.engine_placement":
                sys.meta_path.remove(self)
                import importlib
                importlib.import_module(name)
                patch()
            return None
    sys.meta_path.insert(0, Hook())
