"""A minimal kustomize renderer for the subset deploy/k8s uses, so the tests render the
overlays with no kubectl/kustomize binary and no network (`kubectl kustomize` renders the
same objects; tests/test_deploy.py compares the two wherever kubectl exists).

Supported: resources (files and directories), labels (metadata only), images,
configMapGenerator (envs, literals; behavior create/merge/replace; kustomize's
content-hash name suffix and the pod-spec references to it), strategic-merge patches (the
merge keys of the fields patched here) and replacements (whole values at fieldPaths with
[key=value] selectors). Anything else is refused by name, so a manifest
change that needs more fails loudly instead of rendering differently.

    python deploy/k8s/kustomize_lite.py deploy/k8s/overlays/gpu
"""
from __future__ import annotations

import copy
import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

KNOWN_KEYS = {"apiVersion", "kind", "resources", "labels", "images", "configMapGenerator", "patches", "replacements"}
# Strategic-merge keys (from the Kubernetes API's patchMergeKey) of the lists patched here;
# every other list is replaced, as kustomize does for lists without a merge key.
MERGE_KEYS = {
    "containers": "name", "initContainers": "name", "volumes": "name", "env": "name",
    "envFrom": None, "volumeMounts": "mountPath", "imagePullSecrets": "name",
}
_SEGMENT = re.compile(r"\[[^\]]*\]|[^.\[\]]+")


class KustomizeError(ValueError):
    pass


def _load_docs(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _key(res: dict) -> tuple[str, str]:
    return res["kind"], res["metadata"]["name"]


# ---- generators --------------------------------------------------------------------------
def _env_file(path: Path) -> dict[str, str]:
    data = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            if not sep:
                raise KustomizeError(f"{path}: line {line!r} is not KEY=VALUE")
            data[key.strip()] = value
    return data


def _generated_data(gen: dict, root: Path) -> dict[str, str]:
    unknown = set(gen) - {"name", "envs", "literals", "behavior"}
    if unknown:
        raise KustomizeError(f"configMapGenerator: unsupported {sorted(unknown)}")
    data: dict[str, str] = {}
    for env in gen.get("envs", []):
        data.update(_env_file(root / env))
    for literal in gen.get("literals", []):
        key, _, value = literal.partition("=")
        data[key] = value
    return data


def _config_map_hash(data: dict[str, str]) -> str:
    """kustomize's suffix: sha256 of the JSON {data, kind, name: ""} (Go's encoding), the
    first 10 hex digits with 0,1,3,a,e replaced so the suffix cannot look like a number."""
    encoded = json.dumps({"data": data, "kind": "ConfigMap", "name": ""}, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    encoded = encoded.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    digest = hashlib.sha256(encoded.encode()).hexdigest()[:10]
    return digest.translate(str.maketrans({"0": "g", "1": "h", "3": "k", "a": "m", "e": "t"}))


# ---- transformers ------------------------------------------------------------------------
def _pod_specs(res: dict) -> list[dict]:
    spec = res.get("spec", {})
    if res["kind"] == "Pod":
        return [spec]
    template = spec.get("jobTemplate", {}).get("spec", spec).get("template", {})
    return [template["spec"]] if "spec" in template else []


def _containers(res: dict) -> list[dict]:
    return [c for pod in _pod_specs(res) for c in pod.get("initContainers", []) + pod.get("containers", [])]


def _apply_images(resources: list[dict], images: list[dict]) -> None:
    for image in images:
        unknown = set(image) - {"name", "newName", "newTag", "digest"}
        if unknown:
            raise KustomizeError(f"images: unsupported {sorted(unknown)}")
        for res in resources:
            for container in _containers(res):
                ref = container.get("image", "")
                name, tag = ref, None
                if "@" in name:
                    name = name.split("@", 1)[0]
                elif ":" in name.rsplit("/", 1)[-1]:
                    name, tag = name.rsplit(":", 1)
                if name != image["name"]:
                    continue
                name = image.get("newName", name)
                if "digest" in image:
                    container["image"] = f"{name}@{image['digest']}"
                else:
                    tag = image.get("newTag", tag)
                    container["image"] = f"{name}:{tag}" if tag else name


def _merge_list(base: list, patch: list, key: str | None) -> list:
    if key is None or not all(isinstance(item, dict) and key in item for item in base + patch):
        return copy.deepcopy(patch)
    # Like kustomize: the patch's items first (merged into their base item), then the base
    # items the patch does not name, in their order.
    by_key = {item[key]: item for item in base}
    named = {item[key] for item in patch}
    out = [_merge(by_key[item[key]], item) if item[key] in by_key else copy.deepcopy(item) for item in patch]
    return out + [copy.deepcopy(item) for item in base if item[key] not in named]


def _merge(base: Any, patch: Any, field: str = "") -> Any:
    if isinstance(patch, dict) and isinstance(base, dict):
        if any(k.startswith("$") for k in patch):
            raise KustomizeError(f"strategic-merge directives ({[k for k in patch if k.startswith('$')]}) are not supported")
        out = copy.deepcopy(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = _merge(out[key], value, key)
            else:
                out[key] = copy.deepcopy(value)
        return out
    if isinstance(patch, list) and isinstance(base, list):
        key = "containerPort" if field == "ports" and any("containerPort" in p for p in patch) else MERGE_KEYS.get(field)
        if field == "ports" and key is None:
            key = "port"
        return _merge_list(base, patch, key)
    return copy.deepcopy(patch)


def _apply_patches(resources: list[dict], patches: list[dict], root: Path) -> None:
    for entry in patches:
        unknown = set(entry) - {"path", "patch"}
        if unknown:
            raise KustomizeError(f"patches: unsupported {sorted(unknown)} (strategic-merge patches naming their target only)")
        docs = _load_docs(root / entry["path"]) if "path" in entry else [yaml.safe_load(entry["patch"])]
        for patch in docs:
            if not isinstance(patch, dict) or "kind" not in patch:
                raise KustomizeError("patches: only strategic-merge patches (a partial object with kind and name)")
            matches = [i for i, res in enumerate(resources) if _key(res) == _key(patch)]
            if not matches:
                raise KustomizeError(f"patch target {_key(patch)} not found")
            for i in matches:
                resources[i] = _merge(resources[i], patch)


def _walk(node: Any, path: str) -> tuple[Any, Any]:
    """(parent, key) of the existing field at a kustomize fieldPath like a.b.[name=x].c."""
    segments = _SEGMENT.findall(path)
    if not segments:
        raise KustomizeError(f"empty fieldPath {path!r}")
    for i, seg in enumerate(segments):
        if seg.startswith("["):
            key, _, value = seg[1:-1].partition("=")
            found = [n for n, item in enumerate(node) if isinstance(item, dict) and str(item.get(key)) == value]
            if len(found) != 1:
                raise KustomizeError(f"fieldPath {path}: {len(found)} items match {seg}")
            seg = found[0]
        elif isinstance(node, list):
            seg = int(seg)
        elif seg not in node:
            raise KustomizeError(f"fieldPath {path}: no field {seg!r}")
        if i == len(segments) - 1:
            return node, seg
        node = node[seg]


def _selected(res: dict, select: dict) -> bool:
    unknown = set(select) - {"kind", "name"}
    if unknown:
        raise KustomizeError(f"replacements select: unsupported {sorted(unknown)}")
    return all((res["kind"] if k == "kind" else res["metadata"]["name"]) == v for k, v in select.items())


def _apply_replacements(resources: list[dict], replacements: list[dict]) -> None:
    for rep in replacements:
        src = rep["source"]
        sources = [r for r in resources if _selected(r, {k: src[k] for k in ("kind", "name") if k in src})]
        if len(sources) != 1:
            raise KustomizeError(f"replacement source {src}: {len(sources)} matches")
        parent, key = _walk(sources[0], src.get("fieldPath", "metadata.name"))
        value = parent[key]
        for target in rep["targets"]:
            unknown = set(target) - {"select", "fieldPaths"}
            if unknown:
                raise KustomizeError(f"replacements target: unsupported {sorted(unknown)}")
            for res in resources:
                if not _selected(res, target["select"]):
                    continue
                for field_path in target["fieldPaths"]:
                    node, k = _walk(res, field_path)
                    old = node[k]
                    if isinstance(old, int) and not isinstance(old, bool) and isinstance(value, str) and value.isdigit():
                        node[k] = int(value)  # kustomize keeps the target's type (seen with kustomize v5.5)
                    else:
                        node[k] = copy.deepcopy(value)


# ---- build -------------------------------------------------------------------------------
def _build(root: Path, generated: dict[tuple[str, str], dict]) -> list[dict]:
    path = root / "kustomization.yaml"
    if not path.is_file():
        raise KustomizeError(f"{root}: no kustomization.yaml")
    kust = yaml.safe_load(path.read_text()) or {}
    unknown = set(kust) - KNOWN_KEYS
    if unknown:
        raise KustomizeError(f"{path}: unsupported fields {sorted(unknown)} (use kubectl kustomize, or extend kustomize_lite)")
    resources: list[dict] = []
    for entry in kust.get("resources", []):
        target = (root / entry).resolve()
        resources += _build(target, generated) if target.is_dir() else _load_docs(target)
    for gen in kust.get("configMapGenerator", []):
        data = _generated_data(gen, root)
        behavior = gen.get("behavior", "create")
        key = ("ConfigMap", gen["name"])
        existing = [r for r in resources if _key(r) == key]
        if behavior == "create":
            if existing:
                raise KustomizeError(f"configMapGenerator {gen['name']}: already exists (use behavior: merge)")
            res = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]}, "data": data}
            resources.append(res)
            generated[key] = res
        elif behavior in ("merge", "replace") and existing:
            existing[0]["data"] = {**existing[0].get("data", {}), **data} if behavior == "merge" else data
        else:
            raise KustomizeError(f"configMapGenerator {gen['name']}: behavior {behavior!r} needs an existing ConfigMap")
    _apply_patches(resources, kust.get("patches", []), root)
    for label in kust.get("labels", []):
        if label.get("includeSelectors") or label.get("includeTemplates") or set(label) - {"pairs", "includeSelectors", "includeTemplates"}:
            raise KustomizeError("labels: only metadata labels (no includeSelectors/includeTemplates) are supported")
        for res in resources:
            res["metadata"].setdefault("labels", {}).update(label["pairs"])
    _apply_images(resources, kust.get("images", []))
    _apply_replacements(resources, kust.get("replacements", []))
    return resources


def _rename_config_maps(resources: list[dict], generated: dict[tuple[str, str], dict]) -> None:
    names = {}
    for (_, name), res in generated.items():
        res["metadata"]["name"] = names[name] = f"{name}-{_config_map_hash(res.get('data', {}))}"
    for res in resources:
        for pod in _pod_specs(res):
            for container in pod.get("initContainers", []) + pod.get("containers", []):
                for source in container.get("envFrom", []):
                    ref = source.get("configMapRef")
                    if ref and ref.get("name") in names:
                        ref["name"] = names[ref["name"]]
                for env in container.get("env", []):
                    ref = env.get("valueFrom", {}).get("configMapKeyRef")
                    if ref and ref.get("name") in names:
                        ref["name"] = names[ref["name"]]
            for volume in pod.get("volumes", []):
                ref = volume.get("configMap")
                if ref and ref.get("name") in names:
                    ref["name"] = names[ref["name"]]


def build(root: Path | str) -> list[dict]:
    """Render the kustomization at `root`, as `kubectl kustomize root` would."""
    generated: dict[tuple[str, str], dict] = {}
    resources = _build(Path(root).resolve(), generated)
    _rename_config_maps(resources, generated)
    return resources


if __name__ == "__main__":
    print(yaml.safe_dump_all(build(sys.argv[1] if len(sys.argv) > 1 else "."), sort_keys=False), end="")
