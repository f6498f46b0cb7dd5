"""What TLS between peers costs: the 100 MB numpy array of ``bench/throughput.py``
(client gather and worker -> worker), on a LocalCluster of 2 worker processes x 1 thread,
over plain TCP and over TLS (certificates from a throwaway CA made by ``trustme``), for
redisdask and for Dask ``distributed`` (``protocol="tls"``) side by side.

Runs alternate (the order reversed every other round) so the machine's noise hits every
kind alike; each figure is the median of ``--repeats`` runs, each run the median of 3
transfers after a warm-up.

    python bench/tls_transfer.py [--repeats 3] [--only redisdask|dask]

Needs ``pip install -e '.[test,bench]'`` (trustme, numpy, distributed).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import _tasks
import trustme

from redisdask import Client, LocalCluster, Security, wait

ARRAY_BYTES = 100_000_000
TRANSFERS = 3
MB = 1e6


class Files:
    """A throwaway CA and one certificate it signed, in ``directory``."""

    def __init__(self, directory: Path) -> None:
        ca = trustme.CA()
        cert = ca.issue_cert("127.0.0.1", "redisdask-bench")
        self.ca, self.cert, self.key = (
            str(directory / name) for name in ("ca.pem", "cert.pem", "key.pem")
        )
        ca.cert_pem.write_to_path(self.ca)
        cert.cert_chain_pems[0].write_to_path(self.cert)
        cert.private_key_pem.write_to_path(self.key)


def _median_rate(once: Any) -> float:
    times = [once() for _ in range(TRANSFERS + 1)][1:]  # the first is a warm-up
    return ARRAY_BYTES / MB / statistics.median(times)


def measure(client: Any, wait: Any, scheme: str) -> dict[str, float]:
    """Both systems' clients take the same calls."""
    first, second = sorted(client.scheduler_info()["workers"])[:2]
    assert first.partition("://")[0] == scheme, (first, scheme)
    a = client.submit(_tasks.make_array, ARRAY_BYTES, workers=[first], pure=False)
    a.result()  # a warm-up gather

    def gather() -> float:
        t0 = time.perf_counter()
        value = client.gather(a)
        dt = time.perf_counter() - t0
        assert value.nbytes == ARRAY_BYTES
        del value
        gc.collect()
        return dt

    def worker_to_worker() -> float:
        made = client.submit(_tasks.make_array, ARRAY_BYTES, workers=[first], pure=False)
        wait([made], timeout=120)
        t0 = time.perf_counter()
        nbytes = client.submit(_tasks.consume, made, workers=[second], pure=False).result()
        dt = time.perf_counter() - t0
        assert nbytes == ARRAY_BYTES
        del made
        time.sleep(0.2)  # let the workers drop their copies
        return dt

    return {"gather_MBps": _median_rate(gather), "w2w_MBps": _median_rate(worker_to_worker)}


def run_redisdask(files: Files | None) -> dict[str, float]:
    security = Security(files.ca, files.cert, files.key) if files else Security()
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, nanny=False, security=security) as cluster,
        Client(cluster) as client,
    ):
        return measure(client, wait, security.scheme)


def run_dask(files: Files | None) -> dict[str, float]:
    import distributed
    from distributed.security import Security as DaskSecurity

    options: dict[str, Any] = {}
    if files:
        options["protocol"] = "tls"
        options["security"] = DaskSecurity(
            tls_ca_file=files.ca,
            tls_client_cert=files.cert,
            tls_client_key=files.key,
            tls_scheduler_cert=files.cert,
            tls_scheduler_key=files.key,
            tls_worker_cert=files.cert,
            tls_worker_key=files.key,
            require_encryption=True,
        )
    with (
        _tasks.dask_local_cluster(**options) as cluster,
        distributed.Client(cluster, security=options.get("security")) as client,
    ):
        return measure(client, distributed.wait, "tls" if files else "tcp")


RUNNERS = {"redisdask": run_redisdask, "dask": run_dask}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", choices=sorted(RUNNERS), action="append")
    args = parser.parse_args()
    systems = args.only or list(RUNNERS)
    with tempfile.TemporaryDirectory() as tmp:
        files = Files(Path(tmp))
        kinds = [(system, scheme) for system in systems for scheme in ("tcp", "tls")]
        results: dict[tuple[str, str], list[dict[str, float]]] = {k: [] for k in kinds}
        for r in range(args.repeats):
            for kind in kinds if r % 2 == 0 else reversed(kinds):
                system, scheme = kind
                results[kind].append(RUNNERS[system](files if scheme == "tls" else None))
                print(f"run {r + 1} {system} {scheme}: {results[kind][-1]}", flush=True)
    print(f"\n100 MB array, median of {args.repeats} runs (each the median of {TRANSFERS}):")
    print(f"{'':24}" + "".join(f"{s:>11}{'tcp':>8}{'tls':>8}{'tls/tcp':>8}" for s in systems))
    for metric, label in (
        ("gather_MBps", "client gather, MB/s"),
        ("w2w_MBps", "worker->worker, MB/s"),
    ):
        line = f"{label:24}"
        for system in systems:
            tcp, tls = (
                statistics.median(r[metric] for r in results[(system, scheme)])
                for scheme in ("tcp", "tls")
            )
            line += f"{'':>11}{tcp:>8,.0f}{tls:>8,.0f}{tls / tcp:>8.2f}"
        print(line)


if __name__ == "__main__":
    main()
