#!/usr/bin/env python3
"""Checks deploy/k8s/moe.yaml hangs together (PyYAML):

- every object a manifest names is defined in it: the StatefulSet's
  serviceName (a headless Service), each persistentVolumeClaim, the
  Service the workers register through (the Secret moe-secrets is made by
  kubectl, as the file's header says);
- the workers register through a Service whose endpoints are published
  before the coordinator is ready (publishNotReadyAddresses), on a port it
  serves, selecting the coordinator's pods;
- the coordinator: a Deployment of one replica with strategy Recreate and
  a /readyz readiness probe; every Service selects some pods.

Usage: check_k8s.py FILE. Exit 0 ok, 1 with the problems.
"""
import re
import sys

import yaml


def main():
    path = sys.argv[1]
    docs = [d for d in yaml.safe_load_all(open(path)) if d]
    objs = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    errs = []

    def get(kind, name):
        return objs.get((kind, name))

    pods = {}  # (kind, name) -> pod template
    for (kind, name), d in objs.items():
        if kind in ("Deployment", "StatefulSet"):
            pods[(kind, name)] = d["spec"]["template"]

    def selects(selector):
        return [k for k, t in pods.items()
                if all(t["metadata"].get("labels", {}).get(a) == b for a, b in selector.items())]

    for (kind, name), d in objs.items():
        if kind == "Service" and not selects(d["spec"].get("selector", {})):
            errs.append(f"Service {name} selects no pods")
        if kind in ("Deployment", "StatefulSet"):
            for v in d["spec"]["template"]["spec"].get("volumes", []):
                claim = v.get("persistentVolumeClaim", {}).get("claimName")
                if claim and not get("PersistentVolumeClaim", claim):
                    errs.append(f"{kind} {name}: PersistentVolumeClaim {claim} is not defined")

    coord = get("Deployment", "moe-coordinator")
    if not coord:
        errs.append("no Deployment moe-coordinator")
    else:
        spec = coord["spec"]
        if spec.get("replicas", 1) != 1:
            errs.append("the coordinator Deployment has more than one replica")
        if spec.get("strategy", {}).get("type") != "Recreate":
            errs.append("the coordinator Deployment's strategy is not Recreate")
        c = spec["template"]["spec"]["containers"][0]
        if c.get("readinessProbe", {}).get("httpGet", {}).get("path") != "/readyz":
            errs.append("the coordinator has no /readyz readiness probe")

    sts = get("StatefulSet", "moe-worker")
    if not sts:
        errs.append("no StatefulSet moe-worker")
    else:
        svc = get("Service", sts["spec"].get("serviceName", ""))
        if not svc:
            errs.append(f"StatefulSet serviceName {sts['spec'].get('serviceName')} is not defined")
        elif svc["spec"].get("clusterIP") != "None":
            errs.append("the StatefulSet's Service is not headless (clusterIP: None)")
        c = sts["spec"]["template"]["spec"]["containers"][0]
        cmd = " ".join(c.get("command", []) + c.get("args", []))
        m = re.search(r"--coordinator[ =]tcp://([A-Za-z0-9.-]+):(\d+)", cmd)
        if not m:
            errs.append("the worker has no --coordinator tcp://SERVICE:PORT")
        else:
            host, port = m.group(1).split(".")[0], int(m.group(2))
            reg = get("Service", host)
            if not reg:
                errs.append(f"the workers register through Service {host}: not defined")
            else:
                if not reg["spec"].get("publishNotReadyAddresses"):
                    errs.append(f"Service {host} (registration) waits for readiness: the "
                                "coordinator is ready only after the workers joined")
                if port not in [p["port"] for p in reg["spec"].get("ports", [])]:
                    errs.append(f"Service {host} has no port {port}")
                if ("Deployment", "moe-coordinator") not in selects(reg["spec"]["selector"]):
                    errs.append(f"Service {host} does not select the coordinator")
        for flag in ("--listen", "--data", "--client-listen", "--bulk-listen"):
            if not re.search(flag + r"[ =]tcp://\$POD_IP:", cmd):
                errs.append(f"the worker's {flag} is not on the pod address")

    for e in errs:
        print("check_k8s: " + e)
    if not errs:
        print(f"check_k8s: ok ({len(objs)} objects)")
    return 1 if errs else 0


if __name__ == "__main__":
    sys.exit(main())
