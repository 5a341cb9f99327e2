#!/usr/bin/env python3
"""Tests of helm/kvtier: every configuration tried is linted and rendered by
helm itself (a pinned helm, built by scripts/setup.sh into
tests/helm/.bin), and the rendered objects are checked -- names and kinds,
ports, probes, security, toggles -- and the store's and router's rendered
arguments are run through the real binaries' --check-config.
values.schema.json must accept the defaults and reject bad values.

Two things `helm template` cannot show without a cluster are rendered
otherwise: NOTES.txt (helm renders it only on install; here a copy of the
chart renders it through `tpl` in one more template), and the admin token
an upgrade finds in the cluster (`lookup` finds nothing offline; that one
check renders with Go text/template + sprig, tests/helm/render.go, which
answers lookup from a given cluster). Ends with "N passed, N failed"."""
import copy
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import jsonschema
import yaml

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CHART = os.path.join(ROOT, "helm", "kvtier")
BUILD = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "build")
GOCACHE = os.path.join(tempfile.gettempdir(), "kvtier-gocache")

passed = failed = 0


def check(cond, what):
    global passed, failed
    if cond:
        passed += 1
    else:
        failed += 1
        print("FAIL:", what)


def check_schema_refuses(values, schema, section, cases):
    """The values schema refuses each (key, bad value) put in values[section]."""
    for key, bad in cases:
        w = copy.deepcopy(values)
        w[section][key] = bad
        try:
            jsonschema.validate(w, schema)
            check(False, "schema accepted %s.%s=%r" % (section, key, bad))
        except jsonschema.ValidationError:
            check(True, "")


def load_values():
    with open(os.path.join(CHART, "values.yaml")) as f:
        return yaml.safe_load(f)


HELM = os.path.join(ROOT, "tests", "helm", ".bin", "helm")
_PREVIEW = []  # the chart copy that renders NOTES.txt too (made once)


def _preview_chart():
    """A copy of the chart with one more template: NOTES.txt through tpl."""
    if not _PREVIEW:
        d = tempfile.mkdtemp(prefix="kvtier-chart-")
        dst = os.path.join(d, "kvtier")
        shutil.copytree(CHART, dst)
        shutil.copy(os.path.join(CHART, "templates", "NOTES.txt"),
                    os.path.join(dst, "notes-source.txt"))
        with open(os.path.join(dst, "templates", "zz-notes-preview.yaml"), "w") as f:
            f.write('notes: {{ tpl (.Files.Get "notes-source.txt") . | toJson }}\n')
        _PREVIEW.append(dst)
    return _PREVIEW[0]


def _render_go(values, release, cluster):
    """render.go: Go text/template + sprig, lookup answered from `cluster`."""
    with open(os.path.join(CHART, "Chart.yaml")) as f:
        chart = yaml.safe_load(f)
    ctx = {"Values": values, "Release": {"Name": release, "Namespace": "default"},
           "Chart": {"Name": chart["name"], "Version": chart["version"],
                     "AppVersion": chart["appVersion"]},
           "Cluster": cluster}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(ctx, f)
        path = f.name
    env = dict(os.environ, GO111MODULE="off", GOPATH="/usr/share/gocode", GOCACHE=GOCACHE,
               GOFLAGS="")
    out = subprocess.run(["go", "run", os.path.join(ROOT, "tests", "helm", "render.go"), CHART, path],
                         capture_output=True, text=True, env=env, timeout=300)
    os.unlink(path)
    if out.returncode != 0:
        raise RuntimeError("render failed: " + out.stderr)
    files = {}
    for chunk in out.stdout.split("# Source: ")[1:]:
        name, _, body = chunk.partition("\n")
        files[name] = body
    return files


def render(values, release="kv", cluster=None):
    """The chart's files rendered with `values` (the whole values tree), by
    template file name; each configuration is linted by helm too."""
    if cluster:
        return _render_go(values, release, cluster)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(values, f)
        path = f.name
    try:
        lint = subprocess.run([HELM, "lint", CHART, "-f", path, "--namespace", "default"],
                              capture_output=True, text=True, timeout=120)
        check(lint.returncode == 0, "helm lint: %s%s" % (lint.stdout, lint.stderr))
        out = subprocess.run([HELM, "template", release, _preview_chart(), "-f", path,
                              "--namespace", "default"],
                             capture_output=True, text=True, timeout=120)
    finally:
        os.unlink(path)
    if out.returncode != 0:
        raise RuntimeError("helm template failed: " + out.stderr)
    files = {}
    for doc in out.stdout.split("\n---\n"):
        doc = doc.strip("\n")
        if doc.startswith("---\n"):
            doc = doc[4:]
        if not doc.startswith("# Source: "):
            continue
        source, _, body = doc.partition("\n")
        name = source[len("# Source: "):].split("/templates/", 1)[1]
        if name == "zz-notes-preview.yaml":
            files["NOTES.txt"] = yaml.safe_load(body)["notes"]
            continue
        files[name] = files[name] + "---\n" + body + "\n" if name in files else body + "\n"
    return files


# Every object any check rendered, by its JSON text: validated against the
# Kubernetes API schemas at the end (check_api_schemas).
RENDERED = {}


def objects(files):
    objs = []
    for name, body in files.items():
        if name.endswith(".txt"):
            continue
        for doc in yaml.safe_load_all(body):
            if doc:
                objs.append(doc)
                RENDERED.setdefault(json.dumps(doc, sort_keys=True), name)
    return objs


def validate_k8s(items):
    """Runs tests/helm/validate_k8s.mjs (kubernetes-models) over
    [{"source", "object"}]; returns (exit code, its output)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(items, f)
        path = f.name
    out = subprocess.run(["node", os.path.join(ROOT, "tests", "helm", "validate_k8s.mjs"), path],
                         capture_output=True, text=True, timeout=120,
                         cwd=os.path.join(ROOT, "tests", "helm"))
    os.unlink(path)
    return out.returncode, out.stdout + out.stderr


def check_tenants(values, schema):
    """store.tenantsSecret mounts the Secret and passes --tenants-file; the
    rendered flags, with a real tenants file at that path, pass the store's
    --check-config (which refuses tenants without an admin gate)."""
    v = copy.deepcopy(values)
    v["store"]["tenantsSecret"] = "kv-tenants"
    jsonschema.validate(v, schema)
    sts = find(objects(render(v)), "StatefulSet", "-store")
    pod = sts["spec"]["template"]["spec"]
    c = pod["containers"][0]
    check("--tenants-file=/etc/kvtier/tenants/tenants" in c["args"], "tenants: --tenants-file passed")
    check(any(vol.get("secret", {}).get("secretName") == "kv-tenants" for vol in pod["volumes"]) and
          any(m["mountPath"] == "/etc/kvtier/tenants" for m in c["volumeMounts"]),
          "tenants: the Secret is mounted where the flag points")
    d = tempfile.mkdtemp(prefix="kvtier-chart-tenants-")
    with open(os.path.join(d, "tenants"), "w") as f:
        f.write("secret chart-test\ntenant a ram=1GiB identities=a\n")
    with open(os.path.join(d, "token"), "w") as f:
        f.write("t\n")
    args = [a.replace("/etc/kvtier/tenants/tenants", os.path.join(d, "tenants"))
             .replace("/etc/kvtier/admin/token", os.path.join(d, "token")) for a in c["args"]]
    rc, out = check_config("cachestore/kvtier-store", args)
    check(rc == 0, "tenants: rendered store flags pass --check-config: " + out)
    nodata = [a for a in args if not a.startswith("--admin-token-file")]
    rc, out = check_config("cachestore/kvtier-store", nodata)
    check(rc == 2 and "--admin-token-file" in out, "tenants without an admin gate are refused: " + out)


def check_api_schemas():
    """Every object rendered under any configuration above passes the
    Kubernetes OpenAPI schema, unknown fields refused; and the validator
    does fail an object that breaks it (a misspelt field, a string port)."""
    items = [{"source": src, "object": json.loads(text)} for text, src in RENDERED.items()]
    rc, out = validate_k8s(items)
    check(rc == 0 and "%d passed, 0 failed" % len(items) in out,
          "%d rendered objects pass the Kubernetes API schemas:\n%s" % (len(items), out))
    bad = [{"source": "control", "object": {"apiVersion": "v1", "kind": "Service",
                                            "metadata": {"name": "x"},
                                            "spec": {"portz": [{"port": 80}]}}},
           {"source": "control", "object": {"apiVersion": "v1", "kind": "Service",
                                            "metadata": {"name": "y"},
                                            "spec": {"ports": [{"port": "http"}]}}}]
    rc, out = validate_k8s(bad)
    check(rc != 0 and "/spec/portz" in out and "0 passed, 2 failed" in out,
          "the schema validator refuses an unknown field and a wrongly typed one:\n" + out)


def find(objs, kind, suffix):
    for o in objs:
        if o["kind"] == kind and o["metadata"]["name"].endswith(suffix):
            return o
    return None


def check_config(binary, args):
    args = [a.replace("$(POD_NAME)", "kv-store-0").replace("$(POD_IP)", "10.244.0.7")
            for a in args]
    out = subprocess.run([os.path.join(BUILD, binary)] + args + ["--check-config"],
                         capture_output=True, text=True, timeout=30)
    return out.returncode, out.stdout + out.stderr


def make_certs(dirname):
    """A CA and one certificate it signs, at the paths the chart mounts."""
    def run(*args):
        subprocess.run(["openssl"] + list(args), cwd=dirname, check=True, capture_output=True)
    run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", "ca.key", "-out", "ca.crt", "-days", "1", "-subj", "/CN=kvtier-chart-test")
    run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", "tls.key", "-out", "tls.csr", "-subj", "/CN=kv")
    run("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-set_serial", "1",
        "-days", "1", "-out", "tls.crt")


def check_tls(values, schema):
    """tls.enabled: every process gets the Secret and the flags, probes run
    kvctl health over TLS, and the rendered flags pass --check-config with
    real certificate files."""
    v = copy.deepcopy(values)
    v["tls"]["enabled"] = True
    v["tls"]["dataPlane"] = True
    v["store"]["adminIdentity"] = "kvctl-admin"
    v["exampleWorker"]["enabled"] = True
    jsonschema.validate(v, schema)
    objs = objects(render(v))
    certs = tempfile.mkdtemp(prefix="kvtier-chart-tls-")
    make_certs(certs)
    sts = find(objs, "StatefulSet", "-store")
    dep = find(objs, "Deployment", "-router")
    for obj, binary, server_name in ((sts, "cachestore/kvtier-store", "kv-store-headless"),
                                     (dep, "router/kvtier-router", "kv-router")):
        pod = obj["spec"]["template"]["spec"]
        c = pod["containers"][0]
        for flag in ("--tls-cert=/etc/kvtier/tls/tls.crt", "--tls-key=/etc/kvtier/tls/tls.key",
                     "--tls-ca=/etc/kvtier/tls/ca.crt", "--tls-require-client-cert"):
            check(flag in c["args"], "%s gets %s" % (binary, flag))
        check(any(m["name"] == "tls" and m["mountPath"] == "/etc/kvtier/tls" for m in c["volumeMounts"]) and
              any(vol.get("secret", {}).get("secretName") == "kvtier-tls" for vol in pod["volumes"]),
              "%s mounts the TLS Secret" % binary)
        for probe in ("readinessProbe", "livenessProbe"):
            cmd = c[probe].get("exec", {}).get("command", [])
            check("grpc" not in c[probe] and cmd[:2] == ["kvctl", "health"] and
                  "--tls-server-name=%s" % server_name in cmd and
                  "--tls-cert=/etc/kvtier/tls/tls.crt" in cmd,
                  "%s %s runs kvctl health over mTLS: %s" % (binary, probe, c[probe]))
        args = [a.replace("/etc/kvtier/tls", certs) for a in c["args"]]
        rc, out = check_config(binary, args)
        check(rc == 0, "%s rejects the rendered TLS arguments: %s" % (binary, out))
        env = {e["name"]: e.get("value") for e in c["env"]}
        check(env.get("KVTIER_TLS_CA") == "/etc/kvtier/tls/ca.crt" and
              env.get("KVTIER_TLS_KEY") == "/etc/kvtier/tls/tls.key",
              "kvctl in a %s pod speaks TLS: %s" % (binary, env))
        if binary.endswith("store"):
            check("--admin-identity=kvctl-admin" in c["args"], "store gets --admin-identity")
            check("tls=mutual" in out, "store reports mutual TLS: %s" % out)
            check("--data-tls" in c["args"], "tls.dataPlane gives the store --data-tls")
    worker = find(objs, "Pod", "example-worker")
    env = {e["name"]: e.get("value") for e in worker["spec"]["containers"][0]["env"]}
    check(env.get("KVTIER_TLS_CA") == "/etc/kvtier/tls/ca.crt" and
          env.get("KVTIER_TLS_CERT") == "/etc/kvtier/tls/tls.crt" and
          any(vol.get("secret", {}).get("secretName") == "kvtier-tls" for vol in worker["spec"]["volumes"]),
          "example worker gets the TLS files")
    # Missing files are caught by --check-config.
    rc, out = check_config("router/kvtier-router", dep["spec"]["template"]["spec"]["containers"][0]["args"])
    check(rc == 2 and "/etc/kvtier/tls" in out, "check-config names an unreadable TLS file: %s" % out)
    v["tls"]["secretName"] = ""
    try:
        jsonschema.validate(v, schema)
        check(False, "schema accepted an empty tls.secretName")
    except jsonschema.ValidationError:
        check(True, "")
    subprocess.run(["rm", "-rf", certs])


def engine_arg(args, flag):
    """The value of --flag=VALUE in a container's args (None if absent)."""
    for a in args:
        if a.startswith(flag + "="):
            return a[len(flag) + 1:]
    return None


def check_engine(values, schema):
    """The engine Deployment: vLLM with kvtier's connector, SGLang with its
    HiCache backend, both pointed at every store shard; TLS files passed."""
    stores = "kv-store-0.kv-store-headless:7400,kv-store-1.kv-store-headless:7400"
    check(find(objects(render(values)), "Deployment", "-engine") is None,
          "no engine by default")
    v = copy.deepcopy(values)
    v["engine"]["enabled"] = True
    v["tls"]["enabled"] = True
    jsonschema.validate(v, schema)
    dep = find(objects(render(v)), "Deployment", "-engine")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    check(c["args"][:3] == ["vllm", "serve", v["engine"]["model"]], "vllm serve MODEL")
    kvt = json.loads(engine_arg(c["args"], "--kv-transfer-config") or "{}")
    check(kvt.get("kv_connector") == "KvtierConnector" and
          kvt.get("kv_connector_module_path") == "kvtier.integrations.vllm" and
          kvt.get("kv_load_failure_policy") == "recompute", "vLLM loads kvtier's connector")
    extra = kvt.get("kv_connector_extra_config", {})
    check(extra.get("stores") == stores, "the connector gets every store shard")
    check(extra.get("lookup_wait_ms") == 100 and extra.get("pin_wait_ms") == 1000,
          "the connector's lookup and pin waits from engine.kvtier: %s" % extra)
    # Bounded as the connector bounds them (it refuses what is outside).
    for key, bad in (("lookupWaitMs", 0), ("lookupWaitMs", 60001), ("pinWaitMs", 0),
                     ("pinWaitMs", "1s")):
        w = copy.deepcopy(v)
        w["engine"]["kvtier"][key] = bad
        check_schema_refuses(w["engine"], schema["properties"]["engine"], "kvtier",
                             ((key, bad),))
    # The connector refuses a key it does not know: its own Option(...)
    # entries and the store client's.
    conn_keys = set()
    for part in (("integrations", "vllm_config.py"), ("options.py",)):
        with open(os.path.join(ROOT, "python", "kvtier", *part)) as f:
            conn_keys |= set(re.findall(r'Option\(\s*"(\w+)"', f.read()))
    check("lookup_wait_ms" in conn_keys and set(extra) <= conn_keys,
          "only keys the connector takes: %s" % sorted(set(extra) - conn_keys))
    # vLLM's default (0) aborts the requests in flight on SIGTERM.
    check(engine_arg(c["args"], "--shutdown-timeout") == "95",
          "vLLM drains for the grace period less preStop and 15 s: %s"
          % engine_arg(c["args"], "--shutdown-timeout"))
    check(extra.get("tls_ca") == "/etc/kvtier/tls/ca.crt" and
          any(m["mountPath"] == "/etc/kvtier/tls" for m in c.get("volumeMounts", [])),
          "TLS files mounted and passed to the connector")
    ev = json.loads(engine_arg(c["args"], "--kv-events-config") or "{}")
    check(ev.get("enable_kv_cache_events") is True and ev.get("endpoint") == "tcp://*:5557" and
          ev.get("replay_endpoint") == "tcp://*:5558", "vLLM publishes KV events with a replay socket")
    check(engine_arg(c["args"], "--block-size") == "16", "block size from values")
    check(c["resources"]["limits"].get("nvidia.com/gpu") == "1", "a GPU requested")
    # What a cluster showed: vLLM refuses to start with a container's 64 MiB
    # /dev/shm; the pod mounts a memory emptyDir there.
    pod = dep["spec"]["template"]["spec"]
    check({"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"] and
          {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}} in pod["volumes"],
          "the engine's /dev/shm is a memory emptyDir: %s" % pod["volumes"])
    check("command" not in c, "no command by default: the args run as it")
    w = copy.deepcopy(v)
    w["engine"].update(command=["python3", "-c", "launch()"],
                       extraEnv=[{"name": "HOME", "value": "/tmp"}],
                       extraVolumes=[{"name": "m", "hostPath": {"path": "/models"}}],
                       extraVolumeMounts=[{"name": "m", "mountPath": "/models"}])
    jsonschema.validate(w, schema)
    pod = find(objects(render(w)), "Deployment", "-engine")["spec"]["template"]["spec"]
    c = pod["containers"][0]
    check(c["command"] == ["python3", "-c", "launch()"] and c["args"][:2] == ["vllm", "serve"] and
          {"name": "HOME", "value": "/tmp"} in c["env"] and
          {"name": "m", "mountPath": "/models"} in c["volumeMounts"] and
          {"name": "m", "hostPath": {"path": "/models"}} in pod["volumes"],
          "engine.command, extraEnv, extraVolumes and extraVolumeMounts rendered: %s" % c)
    check_schema_refuses(w, schema, "engine", (("shmSize", "lots"), ("command", "vllm")))
    # vLLM's own offloading with kvtier as its secondary tier.
    v["engine"]["vllmMode"] = "tier"
    v["engine"]["tier"]["cpuBytes"] = 4 << 30
    jsonschema.validate(v, schema)
    c = find(objects(render(v)), "Deployment", "-engine")["spec"]["template"]["spec"]["containers"][0]
    kvt = json.loads(engine_arg(c["args"], "--kv-transfer-config") or "{}")
    spec = kvt.get("kv_connector_extra_config", {})
    tiers = spec.get("secondary_tiers", [{}])
    check(kvt.get("kv_connector") == "OffloadingConnector" and
          spec.get("spec_name") == "TieringOffloadingSpec" and
          spec.get("cpu_bytes_to_use") == 4 << 30 and len(tiers) == 1,
          "vllmMode tier: vLLM's OffloadingConnector with a CPU tier: %s" % kvt)
    t = tiers[0]
    check(t.get("type") == "KvtierTier" and t.get("module_path") == "kvtier.integrations.vllm_tier" and
          t.get("stores") == stores and t.get("io_threads") == 2 and t.get("locality") == "REMOTE" and
          t.get("tls_ca") == "/etc/kvtier/tls/ca.crt" and t.get("deadline_ms") == 10000,
          "kvtier is its secondary tier, with every shard and the TLS files: %s" % t)
    # The tier's keys are the ones KvtierTier accepts (it refuses any other).
    # Its own Option(...) entries and the store client's (options.py).
    tier_keys = {"type", "module_path"}
    for part in (("integrations", "vllm_tier.py"), ("options.py",)):
        with open(os.path.join(ROOT, "python", "kvtier", *part)) as f:
            tier_keys |= set(re.findall(r'Option\(\s*"(\w+)"', f.read()))
    check({"stores", "io_threads", "lookup_budget_ms"} <= tier_keys,
          "the tier's keys read from vllm_tier.py and options.py")
    check(set(t) <= tier_keys, "only keys KvtierTier takes: %s" % sorted(set(t) - tier_keys))
    check_schema_refuses(v, schema, "engine", (("vllmMode", "both"),))
    v["engine"]["vllmMode"] = "connector"
    v["engine"]["kind"] = "sglang"
    jsonschema.validate(v, schema)
    c = find(objects(render(v)), "Deployment", "-engine")["spec"]["template"]["spec"]["containers"][0]
    check(c["args"][:3] == ["python3", "-m", "sglang.launch_server"], "SGLang's launcher")
    check(engine_arg(c["args"], "--hicache-storage-backend") == "dynamic" and
          "--enable-hierarchical-cache" in c["args"], "HiCache with a dynamic backend")
    sg = json.loads(engine_arg(c["args"], "--hicache-storage-backend-extra-config") or "{}")
    check(sg.get("module_path") == "kvtier.integrations.sglang" and
          sg.get("class_name") == "KvtierHiCacheStorage" and sg.get("interface_v1") == 1 and
          sg.get("stores") == stores, "SGLang loads kvtier's backend, zero-copy, every shard")
    check_schema_refuses(v, schema, "engine", (("kind", "trt"), ("blockSize", 0), ("port", 70000)))


def check_disaggregation(values, schema):
    """engine.prefill.replicas > 0: two pools. The prefill Deployment's
    engines are kv_producer, the engine Deployment's kv_both with the
    handoff budget; each pool has its own headless Service and the frontend
    resolves both, each with its role, and gets --pd-threshold; the
    ordinary engine Service reaches decode engines only. Refused for SGLang
    or vLLM's tier mode (the handoff is kvtier's vLLM connector's)."""
    v = copy.deepcopy(values)
    v["engine"]["enabled"] = True
    v["engine"]["prefill"]["replicas"] = 2
    v["engine"]["prefill"]["handoffWaitMs"] = 3000
    v["engine"]["prefill"]["resources"] = {"limits": {"nvidia.com/gpu": 2}}
    jsonschema.validate(v, schema)
    objs = objects(render(v))
    pre = find(objs, "Deployment", "-engine-prefill")
    dec = find(objs, "Deployment", "-engine")
    check(pre is not None and pre["spec"]["replicas"] == 2, "a prefill Deployment of 2 replicas")
    check(dec is not None and dec["spec"]["replicas"] == 1, "the decode Deployment")

    def kv_config(dep):
        c = dep["spec"]["template"]["spec"]["containers"][0]
        return json.loads(engine_arg(c["args"], "--kv-transfer-config") or "{}"), c

    pk, pc = kv_config(pre)
    dk, dc = kv_config(dec)
    check(pk.get("kv_role") == "kv_producer" and dk.get("kv_role") == "kv_both",
          "prefill engines produce; decode engines also serve and save what is not "
          "handed off: %s %s" % (pk, dk))
    check(dk["kv_connector_extra_config"].get("handoff_wait_ms") == 3000 and
          "handoff_wait_ms" not in pk["kv_connector_extra_config"],
          "the decode's handoff budget")
    with open(os.path.join(ROOT, "python", "kvtier", "integrations", "vllm_config.py")) as f:
        check(re.search(r'Option\(\s*"handoff_wait_ms"', f.read()) is not None,
              "handoff_wait_ms is a key the connector takes")
    check(pc["resources"]["limits"].get("nvidia.com/gpu") == "2" and
          dc["resources"]["limits"].get("nvidia.com/gpu") == "1", "each pool's resources")
    labels = pre["spec"]["template"]["metadata"]["labels"]
    check(labels.get("app.kubernetes.io/component") == "engine-prefill" and
          pre["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "engine-prefill",
          "prefill pods are their own component")
    svc = find(objs, "Service", "kv-engine")
    check(svc["spec"]["selector"]["app.kubernetes.io/component"] == "engine",
          "the engine Service reaches decode engines only")
    ph = find(objs, "Service", "-engine-prefill-headless")
    check(ph is not None and ph["spec"]["clusterIP"] == "None" and
          ph["spec"]["selector"]["app.kubernetes.io/component"] == "engine-prefill" and
          {p["port"] for p in ph["spec"]["ports"]} == {8000, 5557, 5558},
          "a headless Service names every prefill pod with its API and events ports")
    fc = find(objs, "Deployment", "-frontend")["spec"]["template"]["spec"]["containers"][0]
    dns = engine_arg(fc["args"], "--engines-dns")
    pool = "events-port=5557,replay-port=5558,namespace=00c0ffee00c0ffee,block-tokens=16"
    check(dns == "name=kv-engine-headless:8000,%s,role=decode;"
          "name=kv-engine-prefill-headless:8000,%s,role=prefill" % (pool, pool),
          "the frontend resolves both pools, each with its role: %s" % dns)
    check(engine_arg(fc["args"], "--pd-threshold") == "512", "the frontend's --pd-threshold")
    rc, out = check_config("frontend/kvtier-frontend", fc["args"])
    check(rc == 0, "kvtier-frontend rejects the rendered two pools: %s" % out)
    check_schema_refuses(v["engine"], schema["properties"]["engine"], "prefill", (
        ("replicas", -1), ("handoffWaitMs", 0), ("handoffWaitMs", 600001)))
    for key, bad in (("kind", "sglang"), ("vllmMode", "tier")):
        w = copy.deepcopy(v)
        w["engine"][key] = bad
        with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
            json.dump(w, f)
            f.flush()
            out = subprocess.run([HELM, "template", "kv", CHART, "-f", f.name],
                                 capture_output=True, text=True, timeout=120)
        check(out.returncode != 0 and "engine.prefill.replicas needs" in out.stderr,
              "a prefill pool with engine.%s=%s refused, naming the setting: %s"
              % (key, bad, out.stderr))


def check_scaling(values, schema):
    """Scaling without losing the cache: every engine pod sleeps
    engine.drain.preStopSeconds before SIGTERM (out of the Services first)
    within its grace period; frontend.deletionCost.enabled gives the
    frontend a ServiceAccount, a Role that may get, list and patch pods and
    nothing else, its RoleBinding, and the --deletion-cost-* flags, which
    kvtier-frontend accepts. Off by default: no RBAC object rendered."""
    v = copy.deepcopy(values)
    v["engine"]["enabled"] = True
    v["engine"]["prefill"]["replicas"] = 1
    jsonschema.validate(v, schema)
    objs = objects(render(v))
    for suffix in ("-engine", "-engine-prefill"):
        pod = find(objs, "Deployment", suffix)["spec"]["template"]["spec"]
        c = pod["containers"][0]
        check(pod.get("terminationGracePeriodSeconds") == 120 and
              c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command") ==
              ["/bin/sh", "-c", "sleep 10"],
              "%s pods leave the Services, then drain within 120 s" % suffix)
    check(not any(o["kind"] in ("ServiceAccount", "Role", "RoleBinding") for o in objs),
          "no RBAC object without frontend.deletionCost.enabled")
    fc = find(objs, "Deployment", "-frontend")["spec"]["template"]["spec"]
    check(engine_arg(fc["containers"][0]["args"], "--deletion-cost-selector") is None and
          "serviceAccountName" not in fc, "no deletion-cost updater by default")
    v["frontend"]["deletionCost"] = {"enabled": True, "interval": "45s"}
    v["engine"]["drain"] = {"preStopSeconds": 20, "terminationGracePeriodSeconds": 300}
    jsonschema.validate(v, schema)
    objs = objects(render(v))
    pod = find(objs, "Deployment", "-engine")["spec"]["template"]["spec"]
    check(pod["terminationGracePeriodSeconds"] == 300 and
          pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][-1] == "sleep 20" and
          engine_arg(pod["containers"][0]["args"], "--shutdown-timeout") == "265",
          "engine.drain sets the grace period, the preStop sleep and vLLM's drain")
    fpod = find(objs, "Deployment", "-frontend")["spec"]["template"]["spec"]
    args = fpod["containers"][0]["args"]
    check(fpod.get("serviceAccountName") == "kv-frontend" and
          fpod.get("automountServiceAccountToken") is True,
          "the frontend runs as its ServiceAccount with the token mounted: %s"
          % fpod.get("serviceAccountName"))
    check(engine_arg(args, "--deletion-cost-selector") ==
          "app.kubernetes.io/instance=kv,app.kubernetes.io/component in (engine,engine-prefill)" and
          engine_arg(args, "--deletion-cost-namespace") == "default" and
          engine_arg(args, "--deletion-cost-interval") == "45s",
          "the updater's flags name both engine pools: %s" % args)
    rc, out = check_config("frontend/kvtier-frontend", args)
    check(rc == 0, "kvtier-frontend rejects the rendered deletion-cost flags: %s" % out)
    sa = find(objs, "ServiceAccount", "-frontend")
    role = find(objs, "Role", "-frontend-deletion-cost")
    binding = find(objs, "RoleBinding", "-frontend-deletion-cost")
    check(sa is not None and sa["metadata"]["name"] == "kv-frontend", "a ServiceAccount")
    check(role is not None and role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "patch"]}],
        "the Role may get, list and patch pods, nothing more: %s" % (role or {}).get("rules"))
    check(binding is not None and binding["roleRef"]["name"] == role["metadata"]["name"] and
          binding["subjects"] == [{"kind": "ServiceAccount", "name": "kv-frontend",
                                   "namespace": "default"}],
          "the RoleBinding gives the Role to the frontend's account")
    for section, key, cases in (
            ("engine", "drain", (("preStopSeconds", -1), ("terminationGracePeriodSeconds", 0),
                                 ("grace", 1))),
            ("frontend", "deletionCost", (("enabled", "yes"), ("interval", "soon"),
                                          ("selector", "x")))):
        for field, bad in cases:
            w = copy.deepcopy(v)
            w[section][key][field] = bad
            try:
                jsonschema.validate(w, schema)
                check(False, "schema accepted %s.%s.%s=%r" % (section, key, field, bad))
            except jsonschema.ValidationError:
                check(True, "")
    w = copy.deepcopy(v)
    w["frontend"]["deletionCost"]["interval"] = "100ms"
    fargs = find(objects(render(w)), "Deployment", "-frontend")["spec"]["template"]["spec"][
        "containers"][0]["args"]
    rc, out = check_config("frontend/kvtier-frontend", fargs)
    check(rc != 0 and "--deletion-cost-interval" in out,
          "an interval under a second is refused, naming the flag: %s" % out)


def check_frontend(values, schema):
    """With vLLM engines the frontend is the entry point: a Deployment
    finding the engines through their headless Service (API, KV events and
    replay ports), probed on /health and /ping, the model's tokenizer
    fetched by an init container, the store shards publishing to its
    router (not under TLS: it speaks plain gRPC), a NetworkPolicy opening
    its HTTP port only, and NOTES that send the first request."""
    check(find(objects(render(values)), "Deployment", "-frontend") is None,
          "no frontend without engines")
    v = copy.deepcopy(values)
    v["engine"]["enabled"] = True
    jsonschema.validate(v, schema)
    files = render(v)
    objs = objects(files)
    dep = find(objs, "Deployment", "-frontend")
    check(dep is not None and dep["spec"]["replicas"] == 2, "a frontend Deployment of 2 replicas")
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    check(c["command"] == ["kvtier-frontend"], "the frontend runs kvtier-frontend")
    dns = engine_arg(c["args"], "--engines-dns")
    check(dns == "name=kv-engine-headless:8000,events-port=5557,replay-port=5558,"
          "namespace=00c0ffee00c0ffee,block-tokens=16",
          "engines by their headless Service, with their events and replay ports: %s" % dns)
    check(engine_arg(c["args"], "--served-model-name") == v["engine"]["model"],
          "the served model is the engine's")
    check(engine_arg(c["args"], "--load-weight") == "0.5" and
          engine_arg(c["args"], "--decode-weight") == "0.05",
          "the routing weights from values: %s" % c["args"])
    check(c["readinessProbe"]["httpGet"]["path"] == "/health" and
          c["livenessProbe"]["httpGet"]["path"] == "/ping", "probes: /health, /ping")
    init = pod.get("initContainers", [{}])[0]
    check(init.get("image") == v["engine"]["image"] and v["engine"]["model"] in init.get("args", []),
          "an init container fetches the model's tokenizer with the engine's image")
    check(pod["securityContext"]["runAsNonRoot"] is True and
          c["securityContext"]["readOnlyRootFilesystem"] is True, "non-root, read-only root")
    rc, out = check_config("frontend/kvtier-frontend", c["args"])
    check(rc == 0, "kvtier-frontend rejects the rendered arguments: %s" % out)
    # SIGTERM comes after the preStop sleep; the drain ends before the
    # grace period does (the kubelet's SIGKILL would cut what drains).
    grace, pre = pod["terminationGracePeriodSeconds"], c["lifecycle"]["preStop"]["exec"]["command"]
    drain = engine_arg(c["args"], "--drain-timeout")
    check(drain is not None and pre[-1] == "sleep 5" and
          int(drain.rstrip("s")) + 5 < grace,
          "the drain fits the grace period after preStop: drain %s, grace %s" % (drain, grace))
    check(engine_arg(c["args"], "--max-connections") == "4096", "the connection cap from values")
    # Metrics on the operator port, scraped through the headless Service;
    # the clients' Service has the API port only; no route header.
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    check(engine_arg(c["args"], "--metrics-listen") == "0.0.0.0:%d" % ports["metrics"] and
          "--route-header" not in c["args"], "metrics on the operator port: %s" % c["args"])
    fh = find(objs, "Service", "-frontend-headless")
    check({p["name"] for p in fh["spec"]["ports"]} == {"router", "metrics"} and
          {p["name"] for p in find(objs, "Service", "-frontend")["spec"]["ports"]} == {"http"},
          "the metrics port is on the headless Service only")
    eh = find(objs, "Service", "-engine-headless")
    check(eh is not None and eh["spec"]["clusterIP"] == "None" and
          {p["port"] for p in eh["spec"]["ports"]} == {8000, 5557, 5558},
          "a headless Service names every engine pod with its API and events ports")
    fs = find(objs, "Service", "-frontend")
    check(fs is not None and fs["spec"]["ports"][0]["port"] == 8000, "the frontend Service")
    store_args = find(objs, "StatefulSet", "-store")["spec"]["template"]["spec"]["containers"][0]["args"]
    check("--router=kv-router-headless:7500,kv-frontend-headless:7600" in store_args,
          "store shards publish to the routers and the frontends: %s" % store_args)
    np = find(objs, "NetworkPolicy", "-frontend")
    check(np is not None and np["spec"]["ingress"][0] == {"ports": [{"port": 8000, "protocol": "TCP"}]}
          and np["spec"]["ingress"][1] == {"ports": [{"port": 9600, "protocol": "TCP"}]},
          "the frontend's HTTP and metrics ports are open, its router port is not")
    notes = files.get("NOTES.txt", "")
    check("kubectl port-forward svc/kv-frontend" in notes and "/v1/completions" in notes,
          "NOTES send the first request through the frontend")
    v["tls"]["enabled"] = True
    store_args = find(objects(render(v)), "StatefulSet", "-store")["spec"]["template"]["spec"]["containers"][0]["args"]
    check("--router=kv-router-headless:7500" in store_args,
          "under TLS the store shards publish to the routers only: %s" % store_args)
    v["tls"]["enabled"] = False
    v["frontend"]["tokenizer"] = {"source": "configMap", "configMap": "llama-tokenizer"}
    pod = find(objects(render(v)), "Deployment", "-frontend")["spec"]["template"]["spec"]
    check("initContainers" not in pod and
          pod["volumes"][0] == {"name": "model", "configMap": {"name": "llama-tokenizer"}},
          "the tokenizer from a ConfigMap: %s" % pod["volumes"])
    hook = find(objects(render(v)), "Pod", "-test-frontend")
    script = hook["spec"]["containers"][0]["args"][0]
    check(hook["metadata"]["annotations"]["helm.sh/hook"] == "test" and
          "host=kv-frontend" in script and "want=200" in script and '"model":"' in script,
          "helm test sends a completion through the frontend Service, wanting 200")
    check("--api-keys-file=/keys/keys" not in pod["containers"][0]["args"] and
          all(vol["name"] != "api-keys" for vol in pod["volumes"]), "no API keys by default")
    v["frontend"]["apiKeys"] = {"secretName": "llama-keys", "tokensPerMinute": 6000}
    v["frontend"]["maxConcurrentRequests"] = 64
    pod = find(objects(render(v)), "Deployment", "-frontend")["spec"]["template"]["spec"]
    c = pod["containers"][0]
    check({"--api-keys-file=/keys/keys", "--key-tokens-per-minute=6000",
           "--max-concurrent-requests=64"} <= set(c["args"]) and
          {"name": "api-keys", "secret": {"secretName": "llama-keys"}} in pod["volumes"] and
          {"name": "api-keys", "mountPath": "/keys", "readOnly": True} in c["volumeMounts"],
          "API keys from a Secret, mounted as the key file: %s" % c["args"])
    rc, out = check_config("frontend/kvtier-frontend", c["args"])
    check(rc == 0, "kvtier-frontend rejects the rendered arguments with keys: %s" % out)
    script = find(objects(render(v)), "Pod", "-test-frontend")["spec"]["containers"][0]["args"][0]
    check("want=401" in script, "with API keys helm test (holding none) wants the 401")
    check_schema_refuses(v, schema, "frontend", (
        ("namespace", "12"), ("replicas", 0), ("maxAttempts", 0), ("loadWeight", -1),
        ("decodeWeight", "high"), ("maxConnections", 0), ("typo", 1),
        ("maxConcurrentRequests", -1), ("queueTimeout", "soon"), ("apiKeys", {"secret": "x"})))
    v["engine"]["kind"] = "sglang"
    files = render(v)
    check(find(objects(files), "Deployment", "-frontend") is None and
          "front door   : none" in files.get("NOTES.txt", ""),
          "no frontend in front of SGLang engines (it reads vLLM's KV events), and NOTES say so")
    v["engine"]["kind"] = "vllm"
    v["frontend"]["enabled"] = False
    check(find(objects(render(v)), "Deployment", "-frontend") is None, "frontend.enabled=false")


def check_vllm_sources(values, schema):
    """router.vllmSources: a ConfigMap in --vllm-sources' format, mounted and
    named by the flag; kvtier-router --check-config accepts the rendered file."""
    objs = objects(render(values))
    check(find(objs, "ConfigMap", "-router-vllm-sources") is None, "no vLLM sources by default")
    v = copy.deepcopy(values)
    v["router"]["vllmSources"] = [
        {"id": "vllm-0", "endpoint": "vllm-0.vllm:8000", "events": "tcp://vllm-0.vllm:5557",
         "replay": "tcp://vllm-0.vllm:5558", "topic": "kv-events", "namespace": "00c0ffee00c0ffee",
         "blockTokens": 16},
        {"id": "vllm-1", "endpoint": "vllm-1.vllm:8000", "events": "tcp://vllm-1.vllm:5557",
         "namespace": "00c0ffee00c0ffee", "blockTokens": 16}]
    jsonschema.validate(v, schema)
    objs = objects(render(v))
    cm = find(objs, "ConfigMap", "-router-vllm-sources")
    lines = [l for l in cm["data"]["sources.txt"].splitlines() if l.strip()]
    check(lines == [
        "id=vllm-0,endpoint=vllm-0.vllm:8000,events=tcp://vllm-0.vllm:5557,"
        "replay=tcp://vllm-0.vllm:5558,topic=kv-events,namespace=00c0ffee00c0ffee,block-tokens=16",
        "id=vllm-1,endpoint=vllm-1.vllm:8000,events=tcp://vllm-1.vllm:5557,"
        "namespace=00c0ffee00c0ffee,block-tokens=16"], "vLLM sources rendered: %r" % lines)
    c = find(objs, "Deployment", "-router")["spec"]["template"]["spec"]["containers"][0]
    check(engine_arg(c["args"], "--vllm-sources") == "/etc/kvtier/vllm/sources.txt" and
          any(m["mountPath"] == "/etc/kvtier/vllm" for m in c.get("volumeMounts", [])),
          "the router reads the mounted sources file")
    # The router itself accepts the rendered file.
    d = tempfile.mkdtemp()
    with open(os.path.join(d, "sources.txt"), "w") as f:
        f.write(cm["data"]["sources.txt"])
    args = [a if not a.startswith("--vllm-sources=") else "--vllm-sources=" + os.path.join(d, "sources.txt")
            for a in c["args"] if not a.startswith("--tls")]
    rc, out = check_config("router/kvtier-router", args)
    check(rc == 0, "kvtier-router --check-config accepts the rendered sources: %s" % out)
    subprocess.run(["rm", "-rf", d])
    w = copy.deepcopy(v)
    w["router"]["vllmSources"][0]["namespace"] = "xyz"
    try:
        jsonschema.validate(w, schema)
        check(False, "schema accepted a bad namespace")
    except jsonschema.ValidationError:
        check(True, "")


def check_source_identities(values, schema):
    """router.sourceIdentities: a ConfigMap in --source-identities' format,
    mounted and named by the flag, accepted by kvtier-router --check-config
    with the chart's TLS flags; refused without mutual TLS."""
    v = copy.deepcopy(values)
    v["tls"]["enabled"] = True
    v["tls"]["requireClientCert"] = True
    v["router"]["sourceIdentities"] = [
        {"identity": "kvtier-store", "kind": "store", "ids": ["kv-store-*"]},
        {"identity": "engine-0", "kind": "worker"}]
    jsonschema.validate(v, schema)
    objs = objects(render(v))
    cm = find(objs, "ConfigMap", "-router-source-identities")
    lines = [l.strip() for l in cm["data"]["identities.txt"].splitlines() if l.strip()]
    check(lines == ["kvtier-store store kv-store-*", "engine-0 worker"],
          "source identities rendered: %r" % lines)
    c = find(objs, "Deployment", "-router")["spec"]["template"]["spec"]["containers"][0]
    check(engine_arg(c["args"], "--source-identities") == "/etc/kvtier/identities/identities.txt" and
          any(m["mountPath"] == "/etc/kvtier/identities" for m in c.get("volumeMounts", [])),
          "the router reads the mounted identities file")
    d = tempfile.mkdtemp()
    make_certs(d)
    with open(os.path.join(d, "identities.txt"), "w") as f:
        f.write(cm["data"]["identities.txt"])
    args = [a.replace("/etc/kvtier/tls", d).replace("/etc/kvtier/identities", d) for a in c["args"]]
    rc, out = check_config("router/kvtier-router", args)
    check(rc == 0, "kvtier-router --check-config accepts the rendered identities: %s" % out)
    subprocess.run(["rm", "-rf", d])
    plain = copy.deepcopy(v)
    plain["tls"]["enabled"] = False
    try:
        render(plain)
        check(False, "rendered sourceIdentities without mutual TLS")
    except RuntimeError as e:
        check("needs tls.enabled and tls.requireClientCert" in str(e), "render error: %s" % e)
    for bad in ({"identity": "x", "kind": "robot"}, {"identity": "x", "kind": "store", "ids": ["*"]},
                {"kind": "store"}):
        w = copy.deepcopy(v)
        w["router"]["sourceIdentities"] = [bad]
        try:
            jsonschema.validate(w, schema)
            check(False, "schema accepted sourceIdentities %r" % bad)
        except jsonschema.ValidationError:
            check(True, "")


def check_admin_token_and_network_policy(values, schema):
    """Without store.adminTokenSecret a token Secret is generated (40
    characters), mounted and required by the store, and the one already in
    the cluster is kept on upgrade; NetworkPolicies admit the chart's pods
    and labelled workers to the stores' and routers' ports."""
    import base64
    objs = objects(render(values))
    secret = find(objs, "Secret", "-admin-token")
    check(secret is not None and secret["metadata"]["annotations"].get("helm.sh/resource-policy") == "keep",
          "an admin token Secret is generated and kept")
    token = base64.b64decode(secret["data"]["token"]).decode() if secret else ""
    check(len(token) == 40 and token.isalnum(), "a 40-character token: %r" % token)
    sts = find(objs, "StatefulSet", "-store")
    c = sts["spec"]["template"]["spec"]["containers"][0]
    check("--admin-token-file=/etc/kvtier/admin/token" in c["args"] and
          any(v.get("secret", {}).get("secretName") == "kv-admin-token"
              for v in sts["spec"]["template"]["spec"]["volumes"]),
          "the store requires the generated token")
    # An upgrade keeps the token in the cluster.
    kept = base64.b64encode(b"k" * 40).decode()
    again = objects(render(values, cluster={"Secret/default/kv-admin-token": {"data": {"token": kept}}}))
    check(find(again, "Secret", "-admin-token")["data"]["token"] == kept, "an upgrade keeps the token")
    # A given Secret: nothing generated, that one mounted.
    v = copy.deepcopy(values)
    v["store"]["adminTokenSecret"] = "ops-token"
    objs2 = objects(render(v))
    check(find(objs2, "Secret", "-admin-token") is None, "no token generated when one is given")
    vols = find(objs2, "StatefulSet", "-store")["spec"]["template"]["spec"]["volumes"]
    check(any(x.get("secret", {}).get("secretName") == "ops-token" for x in vols), "the given Secret is mounted")
    v["store"]["adminTokenSecret"] = ""
    v["store"]["generateAdminToken"] = False
    c3 = find(objects(render(v)), "StatefulSet", "-store")["spec"]["template"]["spec"]["containers"][0]
    check(not any(a.startswith("--admin-token-file") for a in c3["args"]), "admin RPCs open only when asked")
    # NetworkPolicies.
    for comp, ports in (("store", {7400, 7401}), ("router", {7500})):
        np = find(objs, "NetworkPolicy", "-" + comp)
        check(np is not None, "a NetworkPolicy for the %s" % comp)
        if np is None:
            continue
        spec = np["spec"]
        check(spec["podSelector"]["matchLabels"] == {"app.kubernetes.io/instance": "kv",
                                                     "app.kubernetes.io/component": comp},
              "%s policy selects its pods" % comp)
        rule = spec["ingress"][0]
        froms = [f["podSelector"]["matchLabels"] for f in rule["from"]]
        check(froms == [{"app.kubernetes.io/instance": "kv"}, {"kvtier.io/worker": "true"},
                        {"kvtier.io/kvctl": "true"}],
              "%s admits the chart's pods, workers and the kvctl pod: %r" % (comp, froms))
        check({p["port"] for p in rule["ports"]} == ports, "%s data ports %r" % (comp, rule["ports"]))
        check(spec["ingress"][1] == {"ports": [{"port": values[comp]["metricsPort"], "protocol": "TCP"}]},
              "%s metrics open to scrapers" % comp)
    v = copy.deepcopy(values)
    v["networkPolicy"]["enabled"] = False
    check(find(objects(render(v)), "NetworkPolicy", "-store") is None, "networkPolicy.enabled=false")
    # The shared certificate's identity speaks for the chart's sources.
    v = copy.deepcopy(values)
    v["tls"]["enabled"] = True
    v["tls"]["sharedIdentity"] = "kvtier"
    jsonschema.validate(v, schema)
    cm = find(objects(render(v)), "ConfigMap", "-router-source-identities")
    lines = [l.strip() for l in cm["data"]["identities.txt"].splitlines() if l.strip()] if cm else []
    check(lines == ["kvtier store kv-store-*", "kvtier worker kv-*"], "shared identity lines: %r" % lines)


def check_dashboard_variables():
    """The dashboard filters every query by namespace, job and release
    (several releases are never summed together)."""
    dash = json.load(open(os.path.join(CHART, "dashboards", "kvtier.json")))
    names = {v["name"] for v in dash["templating"]["list"]}
    check({"namespace", "job", "release"} <= names,
          "dashboard variables namespace, job, release: %s" % sorted(names))
    rel = [v for v in dash["templating"]["list"] if v["name"] == "release"]
    check(rel and rel[0]["type"] == "query" and not rel[0].get("includeAll")
          and not rel[0].get("multi"),
          "the release variable lists the releases and selects one at a time")
    check(any("kvtier_store_fetch_duration_seconds_bucket" in t["expr"]
              for p in dash["panels"] for t in p.get("targets", [])),
          "the dashboard shows end-to-end fetch latency")
    scope = 'namespace=~"$namespace",job=~"$job",pod=~"$release-.*"'
    for panel in dash["panels"]:
        for t in panel.get("targets", []):
            for m in re.finditer(r"kvtier_[a-z0-9_]+(\{[^}]*\})?", t["expr"]):
                check(m.group(1) is not None and scope in m.group(1),
                      "%s: %s is scoped by namespace, job and release" % (panel["title"], m.group(0)))


# kube-score's checks that do not apply to this chart, each with why.
KUBE_SCORE_IGNORED = {
    # The image tag is pinned to the chart's version and never moves:
    # IfNotPresent is right; Always only adds a registry round trip per start.
    "container-image-pull-policy",
    # Ephemeral storage is the logs and an emptyDir /tmp; RocksDB lives on
    # the PVC. A limit would evict a busy store for its own logs; operators
    # who want one set it in store.resources / router.resources.
    "container-ephemeral-storage-request-and-limit",
    # Replicas spread over nodes by topologySpreadConstraints (on by
    # default, hard with whenUnsatisfiable DoNotSchedule), which kube-score
    # does not read; store.affinity takes an anti-affinity too.
    "deployment-has-host-podantiaffinity",
    "statefulset-has-host-podantiaffinity",
}


# More for the engine Deployment alone: its image is the operator's (vLLM's
# and SGLang's run as root and write compile caches and model downloads
# under the home directory), and one replica per GPU pool is the default a
# GPU's price sets; the chart enforces the rest of the restricted standard.
KUBE_SCORE_IGNORED_ENGINE = {
    "container-security-context-user-group-id",
    "container-security-context-readonlyrootfilesystem",
    "deployment-replicas",
}


def check_kube_score(values):
    """kube-score (installed by scripts/setup.sh) finds nothing in the
    rendered chart beyond the checks ignored above, with CPU limits not
    required: a CPU limit throttles the store's data plane and the router
    in bursts (requests are set, memory is limited). Egress is open on
    purpose (stores, routers and DNS are reached across the cluster), so
    the egress half of pod-networkpolicy is ignored too; and the engine's
    inference API serves whichever clients the operator's own policy
    admits, so the chart puts no NetworkPolicy on the engine."""
    binary = os.path.join(ROOT, "tests", "helm", ".bin", "kube-score")
    check(os.path.exists(binary), "kube-score is installed (scripts/setup.sh)")
    if not os.path.exists(binary):
        return
    engine = dict(values, engine=dict(values["engine"], enabled=True))
    for name, v, only, ignored in (
            ("defaults", values, None, KUBE_SCORE_IGNORED),
            ("engine", engine, "engine.yaml", KUBE_SCORE_IGNORED | KUBE_SCORE_IGNORED_ENGINE),
            ("frontend", engine, ("frontend.yaml", "networkpolicy.yaml"), KUBE_SCORE_IGNORED)):
        if isinstance(only, str):
            only = (only,)
        docs = [body for f, body in render(v).items()
                if not f.endswith(".txt") and (only is None or f in only)]
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
            f.write("\n---\n".join(docs))
            path = f.name
        args = [binary, "score", path, "--output-format", "ci", "--ignore-container-cpu-limit"]
        for t in sorted(ignored):
            args += ["--ignore-test", t]
        out = subprocess.run(args, capture_output=True, text=True, timeout=120)
        os.unlink(path)
        findings = [ln for ln in out.stdout.splitlines()
                    if ln.startswith(("[CRITICAL]", "[WARNING]"))
                    and "does not have a matching egress NetworkPolicy" not in ln
                    and not (ln.startswith("[CRITICAL] kv-engine ")
                             and "does not have a matching NetworkPolicy" in ln)]
        if name == "frontend":  # the other policies' pods are not in this render
            findings = [ln for ln in findings if " kv-frontend " in ln]
        check(not findings, "kube-score on the %s render: %s" % (name, "\n".join(findings)))


def check_app_version():
    """The chart's appVersion is the build's version (CMake's project
    version, which every binary prints with --version)."""
    chart = yaml.safe_load(open(os.path.join(CHART, "Chart.yaml")))
    cmake = open(os.path.join(ROOT, "CMakeLists.txt")).read()
    m = re.search(r"project\(kvtier VERSION ([0-9.]+)", cmake)
    check(m is not None and chart["appVersion"] == m.group(1),
          "Chart.yaml appVersion %r is CMake's project version %r"
          % (chart["appVersion"], m and m.group(1)))


def pod_specs(objs):
    """(kind/name, pod spec) of every Deployment and StatefulSet."""
    return [("%s/%s" % (o["kind"], o["metadata"]["name"]), o["spec"]["template"]["spec"])
            for o in objs if o["kind"] in ("Deployment", "StatefulSet")]


def check_operator_controls(values, schema):
    """Scheduling, the restricted Pod Security standard, start-up and stop,
    and the NetworkPolicy's engine namespaces and kvctl pod."""
    objs = objects(render(values))
    for what, spec in pod_specs(objs):
        check(spec["securityContext"].get("seccompProfile") == {"type": "RuntimeDefault"},
              "%s: seccompProfile RuntimeDefault (restricted Pod Security standard)" % what)
    sts = find(objs, "StatefulSet", "-store")
    spread = sts["spec"]["template"]["spec"].get("topologySpreadConstraints", [])
    check(len(spread) == 1 and spread[0]["topologyKey"] == "kubernetes.io/hostname" and
          spread[0]["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == "store",
          "store shards spread over nodes by default")
    c = sts["spec"]["template"]["spec"]["containers"][0]
    check(c.get("startupProbe", {}).get("failureThreshold") == 180 and
          c["startupProbe"]["periodSeconds"] == 10,
          "the store's startupProbe allows 30 minutes of NVMe recovery")
    check(c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
          == ["/bin/sh", "-c", "sleep 5"], "the store has a preStop")
    check(sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 120,
          "the store's grace period lets the write-back queue drain")
    pols = [o for o in objs if o["kind"] == "NetworkPolicy"]
    check(pols and all({"podSelector": {"matchLabels": {"kvtier.io/kvctl": "true"}}}
                       in p["spec"]["ingress"][0]["from"] for p in pols),
          "NetworkPolicies admit the kvctl pod the NOTES suggest")
    notes = render(values)["NOTES.txt"]
    check("--labels=kvtier.io/kvctl=true" in notes, "NOTES run kvctl with the admitted label")
    check("in this namespace only" in notes, "NOTES say engines of other namespaces are not admitted")
    v = copy.deepcopy(values)
    # Helm merges a values file's maps into the defaults: null drops the default label.
    v["networkPolicy"]["kvctlLabels"] = {"kvtier.io/kvctl": None, "a": "1", "b": "2"}
    v["networkPolicy"]["engineNamespaces"] = {"kubernetes.io/metadata.name": "inference"}
    notes = render(v)["NOTES.txt"]
    check("--labels=a=1,b=2 " in notes, "NOTES join several kvctl labels with commas")
    check("namespaces labelled kubernetes.io/metadata.name=inference" in notes,
          "NOTES name the engine namespaces admitted")

    v = copy.deepcopy(values)
    v["imagePullSecrets"] = [{"name": "regcred"}]
    for comp in ("store", "router"):
        v[comp]["nodeSelector"] = {"kvtier.io/pool": comp}
        v[comp]["tolerations"] = [{"key": "dedicated", "operator": "Equal", "value": "kv",
                                   "effect": "NoSchedule"}]
        v[comp]["affinity"] = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
            {"topologyKey": "topology.kubernetes.io/zone", "labelSelector": {
                "matchLabels": {"app.kubernetes.io/component": comp}}}]}}
        v[comp]["podAnnotations"] = {"example.com/team": "inference"}
        v[comp]["extraArgs"] = ["--log-level=debug"]
        v[comp]["extraEnv"] = [{"name": "UCX_LOG_LEVEL", "value": "info"}]
    v["store"]["topologySpread"]["whenUnsatisfiable"] = "DoNotSchedule"
    v["networkPolicy"]["engineNamespaces"] = {"kubernetes.io/metadata.name": "inference"}
    try:
        jsonschema.validate(v, schema)
        check(True, "")
    except jsonschema.ValidationError as e:
        check(False, "the schema refuses operator controls: %s" % e.message)
    objs = objects(render(v))
    for comp, obj in (("store", find(objs, "StatefulSet", "-store")),
                      ("router", find(objs, "Deployment", "-router"))):
        spec = obj["spec"]["template"]["spec"]
        c = spec["containers"][0]
        check(spec.get("imagePullSecrets") == [{"name": "regcred"}], "%s: imagePullSecrets" % comp)
        check(spec.get("nodeSelector") == {"kvtier.io/pool": comp}, "%s: nodeSelector" % comp)
        check(spec.get("tolerations") == v[comp]["tolerations"], "%s: tolerations" % comp)
        check(spec.get("affinity") == v[comp]["affinity"], "%s: affinity" % comp)
        check(obj["spec"]["template"]["metadata"]["annotations"].get("example.com/team")
              == "inference", "%s: podAnnotations" % comp)
        check("--log-level=debug" in c["args"], "%s: extraArgs" % comp)
        check({"name": "UCX_LOG_LEVEL", "value": "info"} in c.get("env", []), "%s: extraEnv" % comp)
    spread = find(objs, "StatefulSet", "-store")["spec"]["template"]["spec"][
        "topologySpreadConstraints"][0]
    check(spread["whenUnsatisfiable"] == "DoNotSchedule", "the spread can be made a hard rule")
    pols = [o for o in objs if o["kind"] == "NetworkPolicy"]
    check(all(any(peer.get("namespaceSelector") == {"matchLabels": {
        "kubernetes.io/metadata.name": "inference"}} and "podSelector" in peer
        for peer in p["spec"]["ingress"][0]["from"]) for p in pols),
        "NetworkPolicies admit worker pods of the engine namespaces")
    check_schema_refuses(values, schema, "store", (
        ("extraArgs", ["log-level=debug"]), ("topologySpread", {"enabled": True}),
        ("startupProbe", {"periodSeconds": 0, "failureThreshold": 1})))


def main():
    if not os.path.exists(HELM):
        print("FAIL: helm is not installed at %s (scripts/setup.sh builds the pinned one)" % HELM)
        sys.exit(1)
    values = load_values()
    schema = json.load(open(os.path.join(CHART, "values.schema.json")))
    check_app_version()
    check_dashboard_variables()
    check_kube_score(values)

    # The schema accepts the defaults and rejects bad values.
    try:
        jsonschema.validate(values, schema)
        check(True, "")
    except jsonschema.ValidationError as e:
        check(False, "default values fail the schema: %s" % e.message)
    check_schema_refuses(values, schema, "store", (
        ("ramPolicy", "fifo"), ("replicas", 0), ("ramBytes", "lots"), ("grpcPort", 70000),
        ("typo", 1)))
    check_schema_refuses(values, schema, "router", (("fetchCost", -1), ("heartbeatDeadline", "soon")))

    files = render(values)
    objs = objects(files)
    for o in objs:
        check(all(k in o for k in ("apiVersion", "kind", "metadata")) and o["metadata"].get("name"),
              "object without apiVersion/kind/name: %s" % o)
    sts = find(objs, "StatefulSet", "-store")
    dep = find(objs, "Deployment", "-router")
    headless = find(objs, "Service", "-store-headless")
    rsvc = find(objs, "Service", "-router")
    check(sts is not None and dep is not None and headless is not None and rsvc is not None,
          "store StatefulSet, router Deployment and their Services are rendered")
    check(headless["spec"]["clusterIP"] == "None", "store Service is headless")
    check(sts["spec"]["serviceName"] == headless["metadata"]["name"], "StatefulSet uses the headless Service")
    check(sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "120Gi",
          "PVC size from values")
    check(dep["spec"]["replicas"] >= 2, "router has at least two replicas by default")
    pdbs = [o for o in objs if o["kind"] == "PodDisruptionBudget"]
    check(len(pdbs) == 2, "a PodDisruptionBudget for store and router")

    for obj, binary, port_key in ((sts, "cachestore/kvtier-store", "store"), (dep, "router/kvtier-router", "router")):
        pod = obj["spec"]["template"]["spec"]
        c = pod["containers"][0]
        check(pod["securityContext"]["runAsNonRoot"] is True, "%s runs as non-root" % binary)
        check(c["securityContext"]["readOnlyRootFilesystem"] is True, "%s has a read-only root" % binary)
        grpc_port = values[port_key]["grpcPort"]
        check(c["readinessProbe"]["grpc"]["port"] == grpc_port and c["livenessProbe"]["grpc"]["port"] == grpc_port,
              "%s probes grpc.health.v1 on its gRPC port" % binary)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        args = c["args"]
        listen = [a for a in args if a.startswith("--listen=")][0]
        check(listen.endswith(":%d" % ports["grpc"]), "%s --listen matches its grpc port" % binary)
        metrics = [a for a in args if a.startswith("--metrics-listen=")][0]
        check(metrics.endswith(":%d" % ports["metrics"]), "%s --metrics-listen matches its port" % binary)
        ann = obj["spec"]["template"]["metadata"]["annotations"]
        check(ann["prometheus.io/port"] == str(ports["metrics"]), "%s metrics port annotated" % binary)
        rc, out = check_config(binary, args)
        check(rc == 0, "%s rejects the rendered arguments: %s" % (binary, out))
    store_args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    # Every replica: the headless Service, resolved again every routerRefresh.
    router_headless = find(objs, "Service", "-router-headless")
    check(router_headless is not None and router_headless["spec"].get("clusterIP") == "None" and
          router_headless["spec"]["selector"] == rsvc["spec"]["selector"],
          "a headless Service selects the router replicas")
    check("--router=kv-router-headless:%d" % values["router"]["grpcPort"] in store_args and
          "--router-refresh=5s" in store_args,
          "store publishes to every router replica: %s" % store_args)
    # kvctl run with kubectl exec in a store or router pod reaches every
    # shard and the router.
    for obj in (sts, dep):
        env = {e["name"]: e.get("value") for e in obj["spec"]["template"]["spec"]["containers"][0]["env"]}
        check(env.get("KVTIER_STORE") == "kv-store-0.kv-store-headless:7400,kv-store-1.kv-store-headless:7400"
              and env.get("KVTIER_ROUTER") == "kv-router:%d" % values["router"]["grpcPort"],
              "kvctl in a %s pod points at every shard and the router: %s" % (obj["kind"], env))
    # The RAM tier goes to NVMe on SIGTERM within what the grace period
    # leaves after preStop and gRPC's shutdown (120 - 5 - 5).
    check("--persist-on-stop=110s" in store_args,
          "the store keeps its RAM tier on NVMe across a restart: %s" % store_args)
    off = copy.deepcopy(values)
    off["store"]["persistOnStop"] = False
    off_args = find(objects(render(off)), "StatefulSet", "-store")["spec"]["template"]["spec"][
        "containers"][0]["args"]
    check(not any(a.startswith("--persist-on-stop") for a in off_args),
          "store.persistOnStop=false leaves the RAM tier to die with the process")
    check("--data-plane=socket" in store_args,
          "the store's data plane is the socket one unless the values say ucx: %s" % store_args)
    svc_ports = {p["name"]: p["port"] for p in headless["spec"]["ports"]}
    check(svc_ports["grpc"] == values["store"]["grpcPort"] and svc_ports["data"] == values["store"]["dataPort"],
          "store Service ports match the container")

    # A flag the binary does not accept is caught by --check-config.
    rc, out = check_config("cachestore/kvtier-store", store_args + ["--ram-policy=fifo"])
    check(rc == 2 and "--ram-policy" in out, "check-config names a bad flag")

    notes = files.get("NOTES.txt", "")
    check("kvctl" in notes and "KVTIER_STORE=kv-store-0.kv-store-headless:7400,kv-store-1" in notes,
          "NOTES.txt tells how to reach kvctl with the shard addresses")
    check(find(objs, "ServiceMonitor", "") is None and find(objs, "Pod", "example-worker") is None,
          "optional objects are off by default")

    # Toggles: ServiceMonitor, hugepages, RDMA, host networking, example worker.
    v = copy.deepcopy(values)
    v["metrics"]["serviceMonitor"]["enabled"] = True
    v["store"]["hugepages"]["enabled"] = True
    v["store"]["rdma"]["enabled"] = True
    v["store"]["hostNetwork"] = True
    v["store"]["ucxTls"] = "rc,ud,sm"
    v["exampleWorker"]["enabled"] = True
    v["store"]["adminTokenSecret"] = "kvtier-admin"
    jsonschema.validate(v, schema)
    objs = objects(render(v))
    check(find(objs, "ServiceMonitor", "kv") is not None, "ServiceMonitor behind its flag")
    sts = find(objs, "StatefulSet", "-store")
    pod = sts["spec"]["template"]["spec"]
    c = pod["containers"][0]
    check(c["resources"]["limits"].get("hugepages-2Mi") == "8Gi", "hugepages requested")
    check(c["resources"]["limits"].get("rdma/hca_shared_devices_a") == "1", "RDMA resource requested")
    check("IPC_LOCK" in c["securityContext"]["capabilities"].get("add", []), "RDMA adds IPC_LOCK")
    check(pod.get("hostNetwork") is True, "host networking for UCX")
    check({"name": "UCX_TLS", "value": "rc,ud,sm"} in c["env"], "UCX_TLS from values")
    check("--hugepages=true" in c["args"], "store told to use hugepages")
    check("--admin-token-file=/etc/kvtier/admin/token" in c["args"] and
          any(vol.get("secret", {}).get("secretName") == "kvtier-admin" for vol in pod["volumes"]),
          "admin token mounted from its Secret and passed to the store")
    worker = find(objs, "Pod", "example-worker")
    env = {e["name"]: e.get("value") for e in worker["spec"]["containers"][0]["env"]}
    check(env.get("KVTIER_STORE") == "kv-store-0.kv-store-headless:7400,kv-store-1.kv-store-headless:7400",
          "example worker gets the store shard addresses")
    check(env.get("KVTIER_ROUTER") == "kv-router-headless:7500", "example worker gets every router replica")
    check(worker["metadata"]["labels"].get("kvtier.io/worker") == "true",
          "example worker carries the worker label the NetworkPolicies admit")

    check_tls(values, schema)
    check_engine(values, schema)
    check_frontend(values, schema)
    check_disaggregation(values, schema)
    check_scaling(values, schema)
    check_vllm_sources(values, schema)
    check_source_identities(values, schema)
    check_admin_token_and_network_policy(values, schema)
    check_operator_controls(values, schema)
    check_tenants(values, schema)
    check_api_schemas()

    print("%d passed, %d failed" % (passed, failed))
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
