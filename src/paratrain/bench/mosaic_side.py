"""MosaicML Streaming's side of `paratrain bench data`, run by the Python of its own virtual
environment (it imports nothing of paratrain):

    python mosaic_side.py write TOKENS.npy MDS_DIR REMOTE CACHE BATCH WORKERS SHARD_MB
    python mosaic_side.py read  TOKENS.npy MDS_DIR REMOTE CACHE BATCH WORKERS SHARD_MB

`write` turns the token rows into MDS shards in MDS_DIR (the bench uploads them to REMOTE); `read`
streams REMOTE into CACHE through a DataLoader for two passes, cold then warm, and prints their
seconds as JSON. S3_ENDPOINT_URL and the AWS keys in the environment point it at the local server.
"""

import importlib.machinery
import json
import sys
import time
import types


def stub_torchvision() -> None:
    """`import streaming` imports torchvision, whose PyPI wheel does not load against the CPU
    build of torch; the token path uses none of it, so a stub of the names it imports will do."""

    class VisionDataset:
        def __init__(self, *args, **kwargs):
            pass

    tv = types.ModuleType("torchvision")
    datasets = types.ModuleType("torchvision.datasets")
    vars(datasets).update(VisionDataset=VisionDataset, CIFAR10=VisionDataset)
    transforms = types.ModuleType("torchvision.transforms")
    functional = types.ModuleType("torchvision.transforms.functional")
    vars(functional).update(to_tensor=lambda x: x)
    vars(transforms).update(functional=functional)
    vars(tv).update(datasets=datasets, transforms=transforms)
    for module in (tv, datasets, transforms, functional):  # find_spec() asks for a spec
        module.__spec__ = importlib.machinery.ModuleSpec(module.__name__, None)
        sys.modules[module.__name__] = module


def main() -> None:
    step, tokens_path, mds_dir, remote, cache, batch, workers, shard_mb = sys.argv[1:9]
    stub_torchvision()
    import numpy as np
    import torch
    from streaming import MDSWriter, StreamingDataset
    from torch.utils.data import DataLoader

    if step == "write":
        rows = np.load(tokens_path, mmap_mode="r")
        with MDSWriter(out=mds_dir, columns={"tokens": "bytes"}, size_limit=int(float(shard_mb) * 2**20)) as out:
            for row in rows:
                out.write({"tokens": row.tobytes()})
        print(json.dumps({"samples": len(rows)}))
        return

    class Tokens(StreamingDataset):
        def __getitem__(self, i):
            row = torch.from_numpy(np.frombuffer(super().__getitem__(i)["tokens"], dtype=np.uint16).astype(np.int64))
            return row[:-1], row[1:]

    ds = Tokens(remote=remote, local=cache, shuffle=True, shuffle_seed=0, batch_size=int(batch))
    loader: DataLoader = DataLoader(ds, batch_size=int(batch), num_workers=int(workers), drop_last=True)
    seconds = []
    for _ in range(2):
        t0 = time.perf_counter()
        for _ in loader:
            pass
        seconds.append(time.perf_counter() - t0)
    print(json.dumps({"cold_s": seconds[0], "warm_s": seconds[1]}))


if __name__ == "__main__":
    main()
