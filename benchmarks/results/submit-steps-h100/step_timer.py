# scratch: times the steps of engine placement's submit (the first layer's early copy) in a transfer.py phase
import atexit, functools, json, os, threading, time
OUT = os.environ.get("STEPS_OUT")
if OUT:
    times = {}
    main_ident = threading.main_thread().ident
    def wrap(owner, name, label):
        fn = getattr(owner, name)
        @functools.wraps(fn)
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                if threading.get_ident() == main_ident:
                    times.setdefault(label, []).append((time.perf_counter() - t0) * 1e6)
        setattr(owner, name, timed)
    from kvstrata.core.engine import placement, engine_placement, transfer_queue, requests
    from kvstrata.native import cuda_executor, load_issuer
    EP = engine_placement.EnginePlacement
    wrap(placement.Placement, "submit_retrieve", "submit_retrieve (all)")
    wrap(EP, "_first_layer_ahead", "ahead: _first_layer_ahead (all)")
    wrap(EP, "_fits", "ahead: _fits")
    wrap(requests.ChunkLocations, "as_retrieve_reply", "as_retrieve_reply (ahead and _locate)")
    wrap(transfer_queue.TransferQueue, "first_layer_ahead", "ahead: TransferQueue.first_layer_ahead")
    wrap(EP, "_generations_for", "_generations_for (ahead and _locate)")
    wrap(cuda_executor.CudaLocalCopier, "stage_first_layer", "ahead: stage_first_layer")
    wrap(cuda_executor, "back_to_back_job", "back_to_back_job")
    wrap(cuda_executor.CudaTransferEngine, "staging", "engine.staging")
    wrap(cuda_executor.CudaTransferEngine, "copy_into_staging", "engine.copy_into_staging")
    wrap(load_issuer.LoadIssuer, "hand_over", "issuer.hand_over")
    wrap(load_issuer.LoadIssuer, "_submit", "issuer._submit")
    wrap(load_issuer.LoadIssuer, "_record", "issuer._record")
    wrap(load_issuer.LoadIssuer, "memcpy2d_runs", "issuer.memcpy2d_runs")
    wrap(EP, "_start", "_start (plan at submit)")
    wrap(transfer_queue.TransferQueue, "_locate", "queue._locate")
    wrap(transfer_queue.TransferQueue, "_enqueue_slices", "queue._enqueue_slices")
    wrap(placement, "BlockTable", "BlockTable()")
    # the issuer's lock: time to take it on the main thread
    orig_program = load_issuer.LoadIssuer.program
    import contextlib
    @contextlib.contextmanager
    def program(self):
        if getattr(self._local, "program", None) is None and threading.get_ident() == main_ident:
            t0 = time.perf_counter(); self._lock.acquire(); times.setdefault("issuer lock wait", []).append((time.perf_counter() - t0) * 1e6)
            try:
                with orig_program(self) as p:
                    yield p
            finally:
                self._lock.release()
        else:
            with orig_program(self) as p:
                yield p
    load_issuer.LoadIssuer.program = program
    def dump():
        import statistics
        res = {k: {"n": len(v), "median_us": round(statistics.median(v), 1), "p90_us": round(sorted(v)[int(0.9 * (len(v) - 1))], 1),
                   "max_us": round(max(v), 1)} for k, v in times.items()}
        with open(f"{OUT}.{os.getpid()}.json", "w") as f:
            json.dump(res, f, indent=1)
    atexit.register(dump)
