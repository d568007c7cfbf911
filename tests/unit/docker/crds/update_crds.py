"""Rewrite the vendored CRD schemas here from git clones of Strimzi and KubeRay (see README.md).

    git clone --branch 1.2.0 --depth 1 https://github.com/strimzi/strimzi-kafka-operator strimzi
    git clone --branch v1.7.0 --depth 1 https://github.com/ray-project/kuberay kuberay
    .venv/bin/python tests/unit/docker/crds/update_crds.py strimzi kuberay

Each file is the `openAPIV3Schema` of the CRD's `v1` version with its `description` texts left out
(they are most of the bytes and validate nothing), as JSON with sorted keys.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
STRIMZI_TAG, KUBERAY_TAG = "1.2.0", "v1.7.0"
STRIMZI = [
    "packaging/install/cluster-operator/040-Crd-kafka.yaml",
    "packaging/install/cluster-operator/045-Crd-kafkanodepool.yaml",
    "packaging/install/cluster-operator/043-Crd-kafkatopic.yaml",
    "packaging/install/cluster-operator/044-Crd-kafkauser.yaml",
]
KUBERAY = ["ray-operator/config/crd/bases/ray.io_rayclusters.yaml"]


def _without_descriptions(node):
    if isinstance(node, dict):
        return {k: _without_descriptions(v) for k, v in node.items() if not (k == "description" and isinstance(v, str))}
    if isinstance(node, list):
        return [_without_descriptions(v) for v in node]
    return node


def vendor(repo: Path, tag: str, path: str, version: str = "v1") -> Path:
    text = subprocess.run(["git", "-C", str(repo), "show", f"{tag}:{path}"], capture_output=True, text=True, check=True)
    crd = yaml.safe_load(text.stdout)
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    doc = {
        "group": group,
        "kind": kind,
        "version": version,
        "openAPIV3Schema": _without_descriptions(served["schema"]["openAPIV3Schema"]),
    }
    out = HERE / f"{kind.lower()}-{group.split('.')[0]}-{version}.json"
    out.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("strimzi", type=Path, help=f"a clone of strimzi/strimzi-kafka-operator with tag {STRIMZI_TAG}")
    parser.add_argument("kuberay", type=Path, help=f"a clone of ray-project/kuberay with tag {KUBERAY_TAG}")
    args = parser.parse_args()
    for path in STRIMZI:
        print(vendor(args.strimzi, STRIMZI_TAG, path).name)
    for path in KUBERAY:
        print(vendor(args.kuberay, KUBERAY_TAG, path).name)


if __name__ == "__main__":
    main()
