#!/usr/bin/env python3
"""An OCI image as a docker-archive tar (what ``ctr images import`` loads),
written from local folders with no base image and no registry: each folder
given becomes one layer, in order. A name without a registry
(``kvtier:0.1.0``) is what the kubelet asks containerd for as
``docker.io/library/kvtier:0.1.0``, so a chart's ``image: kvtier:0.1.0``
with ``IfNotPresent`` finds it.

Usage: mkimage.py OUT.tar NAME:TAG LAYER_DIR [LAYER_DIR ...]
       [--entrypoint JSON] [--cmd JSON] [--env K=V ...]

A layer's files keep their modes, owners and links; their times are zeroed,
so the same folders give the same image.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import tarfile


def layer_of(folder: str) -> bytes:
    """The folder's contents as one uncompressed layer tar."""
    out = io.BytesIO()

    def zero_time(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.mtime = 0
        return info

    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as t:
        for name in sorted(os.listdir(folder)):
            t.add(os.path.join(folder, name), arcname=name, filter=zero_time)
    return out.getvalue()


def main() -> None:
    """Writes the image tar the arguments describe."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("ref")
    ap.add_argument("layers", nargs="+")
    ap.add_argument("--entrypoint", default=None)
    ap.add_argument("--cmd", default=None)
    ap.add_argument("--env", action="append", default=[])
    a = ap.parse_args()
    layers = [layer_of(d) for d in a.layers]
    diff_ids = ["sha256:" + hashlib.sha256(b).hexdigest() for b in layers]
    env = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", *a.env]
    config: dict[str, object] = {"Env": env, "WorkingDir": "/"}
    if a.entrypoint:
        config["Entrypoint"] = json.loads(a.entrypoint)
    if a.cmd:
        config["Cmd"] = json.loads(a.cmd)
    image = {
        "architecture": "amd64",
        "os": "linux",
        "created": "1970-01-01T00:00:00Z",
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
        "history": [{"created_by": "scripts/k8s/mkimage.py"} for _ in layers],
    }
    image_bytes = json.dumps(image, sort_keys=True).encode()
    image_name = hashlib.sha256(image_bytes).hexdigest() + ".json"
    layer_names = [d[len("sha256:"):] + "/layer.tar" for d in diff_ids]
    manifest = [{"Config": image_name, "RepoTags": [a.ref], "Layers": layer_names}]
    entries = [(image_name, image_bytes), *zip(layer_names, layers),
               ("manifest.json", json.dumps(manifest).encode())]  # fmt: skip
    with tarfile.open(a.out, "w") as out:
        for name, data in entries:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            out.addfile(info, io.BytesIO(data))
    size = sum(map(len, layers)) >> 20
    print(f"{a.ref}: {len(layers)} layers, {size} MiB -> {a.out}")


if __name__ == "__main__":
    main()
