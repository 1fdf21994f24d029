"""`zoo compare --ray`: each model's cells (those sharing an architecture and quantization, as the local loop builds,
quantizes and scores a model once for them) as one Ray task that holds a whole machine while it measures: every CPU
of a node, or one GPU and its share of the node's CPUs on CUDA, so no neighbour disturbs its timings. A task measures
its machine's rates itself, so each floor is priced on the machine that ran the cell, and streams a row back as each
cell finishes; the driver alone writes results.jsonl, a row as it arrives, so a killed driver loses only the cells
in flight and a re-run continues where it stopped, as the local path does.
Ray is the optional extra `.[ray]`; it is imported only here, only when asked for."""
import socket
from collections.abc import Callable, Iterator

import torch

from harness.compare_device import is_cuda
from harness.results import ResultStore

# measure(cells) -> each cell's row, and any line of text to print (harness.compare.measure_model_cells)
Measure = Callable[[list[dict]], Iterator[dict | str]]


def measure_task(measure: Measure, cells: list[dict], threads: int) -> Iterator[dict | str]:
    """One model's cells on a Ray worker, with the threads of the CPUs it holds; a line of text names the worker."""
    torch.set_num_threads(threads)
    for item in measure(cells):
        yield f"{socket.gethostname()}, {item}" if isinstance(item, str) else item


def connect(address: str) -> None:
    """Join the cluster at `address` ("auto": the one this machine is in), or start a new one here ("local")."""
    import ray

    if not ray.is_initialized():  # a caller's own ray.init (a test's 2-CPU instance) is used as it is
        ray.init(address=address, include_dashboard=False, log_to_driver=False)


def task_resources(device: str) -> dict:
    """What a task holds. CPU: as many CPUs as the largest node has, so a task runs only on a node it fills (smaller
    nodes sit out). CUDA: one GPU and the fewest CPUs per GPU of any GPU node, so every GPU can take a task."""
    import ray

    nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]]
    if not is_cuda(device):
        cpus = max(int(r.get("CPU", 0)) for r in nodes)
        if not cpus:  # a request of no CPUs would let every task run at once on one node
            raise ValueError("the Ray cluster has no node with CPUs to measure on")
        return {"num_cpus": cpus}
    gpu_nodes = [r for r in nodes if r.get("GPU")]
    if not gpu_nodes:
        raise ValueError(f"device {device!r}: the Ray cluster has no GPU")
    return {"num_gpus": 1, "num_cpus": min(int(r.get("CPU", 0) // r["GPU"]) for r in gpu_nodes)}


def measure_on_ray(groups: list[list[dict]], measure: Measure, address: str, device: str, store: ResultStore,
                   bar) -> None:
    """Each group of cells (one model's) as a streaming Ray task running measure(cells); rows are written here as
    they arrive. measure is passed in, so this module imports nothing of `zoo compare`'s."""
    import ray

    connect(address)
    resources = task_resources(device)
    task = ray.remote(measure_task).options(num_returns="streaming", **resources)
    threads = max(1, resources["num_cpus"])
    pending = [task.remote(measure, cells, threads) for cells in groups]
    try:
        while pending:
            ready, _ = ray.wait(pending, num_returns=1)
            for stream in ready:
                try:
                    item = ray.get(next(stream))
                except StopIteration:  # the task's cells are all written
                    pending.remove(stream)
                    continue
                if isinstance(item, str):
                    print(item, flush=True)
                else:
                    store.append(item)
                    bar.update()
    except BaseException:
        for stream in pending:  # finished rows are on disk; the cells in flight are dropped
            ray.cancel(stream)
        raise
