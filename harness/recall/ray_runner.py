"""`zoo recall --ray`: each run of a sweep as a Ray task (one GPU per task where the sweep runs on CUDA, one CPU
otherwise), for grids that outgrow one machine. The driver alone writes results.jsonl, a row as each task finishes,
so a killed driver loses only the runs in flight and a re-run continues where it stopped, as the local path does.
Ray is the optional extra `.[ray]`; it is imported only here, only when asked for."""
import torch

from harness.results import ResultStore


def train_task(train_fn, run: dict, settings, data) -> dict:
    """One run on a Ray worker: one thread, as each local worker process uses on a 2-core machine."""
    torch.set_num_threads(1)
    return train_fn(run, settings, data, lambda text: None)


def connect(address: str) -> None:
    """Join the cluster at `address` ("auto": the one this machine belongs to), or start a local one ("local")."""
    try:
        import ray
    except ImportError:
        raise ValueError("zoo recall --ray needs Ray: pip install -e '.[ray]'") from None
    if not ray.is_initialized():
        ray.init(address=None if address == "local" else address, include_dashboard=False, log_to_driver=False)


def train_on_ray(todo: list[dict], settings, data: dict, store: ResultStore, bar, train_fn) -> None:
    """train_fn(run, settings, data[run["seed"]], report) -> row: `zoo recall`'s train_run, or `zoo probe`'s
    (passed in, so this module imports neither suite)."""
    import ray

    connect(settings.ray)
    on_gpu = settings.device.startswith("cuda")
    task = ray.remote(num_cpus=1, num_gpus=1 if on_gpu else 0)(train_task)
    # each seed's training and test sets go to the object store once, not with every task
    refs = {seed: ray.put(seed_data) for seed, seed_data in data.items()}
    pending = {task.remote(train_fn, run, settings, refs[run["seed"]]): run for run in todo}
    try:
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                pending.pop(ref)
                store.append(ray.get(ref))
                bar.update()
    except BaseException:
        for ref in pending:  # finished rows are on disk; the runs in flight are dropped
            ray.cancel(ref)
        raise
