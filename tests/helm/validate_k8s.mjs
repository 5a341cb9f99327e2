// Validates Kubernetes objects against the API's OpenAPI schemas, through
// the kubernetes-models package (its classes carry the schemas of the
// Kubernetes release it was generated from), and refuses fields the schema
// does not know, as the API server's strict field validation does: the
// object is validated through a Proxy that records which properties the
// schema's validator reads; a property it never reads (and no map
// enumerates) is unknown.
//
// Usage: node validate_k8s.mjs OBJECTS.json
// OBJECTS.json: [{"source": "templates/x.yaml", "object": {...}}, ...]
// Prints one line per object that fails (source, kind, name, the schema's
// words), then "N passed, N failed"; exits 1 when any failed.
import { readFileSync } from "node:fs";

// A view of value whose reads are recorded in seen (a Set of paths).
function watched(value, path, seen) {
  if (value === null || typeof value !== "object") return value;
  return new Proxy(value, {
    get(target, key, receiver) {
      if (typeof key === "string") seen.add(`${path}/${key}`);
      return watched(Reflect.get(target, key, receiver), `${path}/${String(key)}`, seen);
    },
    ownKeys(target) {
      for (const key of Reflect.ownKeys(target)) seen.add(`${path}/${String(key)}`);
      return Reflect.ownKeys(target);
    },
  });
}

// Paths of value's properties that are not in seen.
function unread(value, path, seen, out) {
  if (value === null || typeof value !== "object") return out;
  for (const key of Object.keys(value)) {
    const p = `${path}/${key}`;
    if (!seen.has(p)) out.push(p);
    else unread(value[key], p, seen, out);
  }
  return out;
}

// API groups of custom resources the chart renders, and the package whose
// models carry their CRDs' schemas.
const CRD_PACKAGES = {
  "monitoring.coreos.com": "@kubernetes-models/prometheus-operator",
};

const items = JSON.parse(readFileSync(process.argv[2], "utf8"));
let passed = 0;
let failed = 0;
for (const { source, object } of items) {
  const where = `${source}: ${object.kind} ${object.metadata?.name ?? "?"}`;
  const group = object.apiVersion ?? "";
  let Model;
  try {
    const pkg = CRD_PACKAGES[group.split("/")[0]] ?? "kubernetes-models";
    const mod = await import(`${pkg}/${group}/${object.kind}`);
    Model = mod[object.kind];
  } catch (e) {
    console.log(`FAIL: ${where}: no schema for apiVersion ${group} kind ${object.kind}`);
    failed += 1;
    continue;
  }
  const seen = new Set(["/apiVersion", "/kind"]);
  try {
    // The model copies the object; its validate runs on the watched copy.
    const model = new Model(object);
    Model.prototype.validate.call(watched(model, "", seen));
  } catch (e) {
    console.log(`FAIL: ${where}: ${e.message}`);
    failed += 1;
    continue;
  }
  const unknown = unread(object, "", seen, []);
  if (unknown.length > 0) {
    console.log(`FAIL: ${where}: fields the schema does not know: ${unknown.join(", ")}`);
    failed += 1;
    continue;
  }
  passed += 1;
}
console.log(`${passed} passed, ${failed} failed`);
process.exit(failed > 0 ? 1 : 0);
