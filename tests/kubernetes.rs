//! The Kubernetes manifests of `deploy/kubernetes/` are valid objects of a
//! fixed Kubernetes version (checked by `kubernetes-validate`, which bundles
//! the API schemas and so runs offline; `scripts/test.sh` installs it), and
//! they agree with each other and with the binaries: every flag exists,
//! every `$(VAR)` is defined, the master and the pservers bind to the pod's
//! IP (the address they publish in etcd), the pservers share one
//! ReadWriteMany checkpoint volume, and so on.
//!
//! A missing validator fails the test rather than skipping it.

use serde_json::Value;
use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
    process::{Command, Output},
};

/// The Kubernetes version the manifests are validated against.
const KUBERNETES_VERSION: &str = "1.29.0";
/// Where `scripts/test.sh` installs the validator.
const INSTALLED: &str = "/opt/oar-test-venv/bin/kubernetes-validate";
/// Overrides where the validator is looked for.
const OVERRIDE: &str = "OAR_KUBERNETES_VALIDATE";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// The YAML files of deploy/kubernetes/, sorted.
fn manifests() -> Vec<PathBuf> {
    let dir = root().join("deploy/kubernetes");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .map(|entry| entry.expect("a directory entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml" || e == "yml"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no YAML files in {}", dir.display());
    files
}

/// The validator: `$OAR_KUBERNETES_VALIDATE`, the one scripts/test.sh
/// installs, or one on PATH. Panics (never skips) when there is none.
fn validator() -> PathBuf {
    if let Some(path) = std::env::var_os(OVERRIDE) {
        return PathBuf::from(path);
    }
    if Path::new(INSTALLED).is_file() {
        return PathBuf::from(INSTALLED);
    }
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths).map(|p| p.join("kubernetes-validate")).find(|p| p.is_file())
    });
    on_path.unwrap_or_else(|| {
        panic!(
            "kubernetes-validate not found (at {INSTALLED}, ${OVERRIDE} or on PATH): \
             run scripts/test.sh, which installs it, or scripts/test.sh --test integration kubernetes::"
        )
    })
}

/// Run the validator (strict: unknown fields are errors) over `files` of
/// `dir` (relative names: its output is split at spaces).
fn validate(dir: &Path, files: &[&str]) -> (Output, String) {
    let validator = validator();
    let output = Command::new(&validator)
        .current_dir(dir)
        .args(["--kubernetes-version", KUBERNETES_VERSION, "--strict"])
        .args(files)
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e} (run scripts/test.sh to install it)", validator.display()));
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    (output, stdout)
}

/// Prints the non-empty documents of the YAML file `argv[1]` as a JSON list.
const YAML_TO_JSON: &str =
    "import json, sys, yaml; print(json.dumps([d for d in yaml.safe_load_all(open(sys.argv[1])) if d]))";

/// Every document of a YAML file as JSON, parsed by the validator's own
/// Python (PyYAML), the interpreter its entry point names.
fn documents(file: &Path) -> Vec<Value> {
    let validator = validator();
    let script = read(&validator);
    let shebang = script.lines().next().and_then(|l| l.strip_prefix("#!")).unwrap_or_else(|| {
        panic!("{} has no #! line naming its Python", validator.display());
    });
    let mut words = shebang.split_whitespace();
    let mut python = words.next().expect("an interpreter after #!");
    if python.ends_with("/env") {
        python = words.next().expect("an interpreter after #!/usr/bin/env");
    }
    let output = Command::new(python)
        .args(["-c", YAML_TO_JSON])
        .arg(file)
        .output()
        .unwrap_or_else(|e| panic!("run {python}: {e}"));
    assert!(
        output.status.success(),
        "{python} could not parse {}: {}",
        file.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    match serde_json::from_slice(&output.stdout) {
        Ok(Value::Array(docs)) => docs,
        other => panic!("{}: not a list of documents: {other:?}", file.display()),
    }
}

/// Every object of deploy/kubernetes/, keyed by (kind, name).
fn objects() -> BTreeMap<(String, String), Value> {
    let mut objects = BTreeMap::new();
    for file in manifests() {
        for doc in documents(&file) {
            let key = (str_at(&doc, "/kind").to_string(), str_at(&doc, "/metadata/name").to_string());
            assert!(objects.insert(key.clone(), doc).is_none(), "{key:?} defined twice");
        }
    }
    objects
}

fn at<'a>(v: &'a Value, pointer: &str) -> &'a Value {
    v.pointer(pointer).unwrap_or_else(|| panic!("no {pointer} in {v}"))
}

fn str_at<'a>(v: &'a Value, pointer: &str) -> &'a str {
    at(v, pointer).as_str().unwrap_or_else(|| panic!("{pointer} is not a string in {v}"))
}

fn list_at<'a>(v: &'a Value, pointer: &str) -> &'a [Value] {
    v.pointer(pointer).and_then(Value::as_array).map(Vec::as_slice).unwrap_or(&[])
}

fn object<'a>(objects: &'a BTreeMap<(String, String), Value>, kind: &str, name: &str) -> &'a Value {
    objects.get(&(kind.to_string(), name.to_string())).unwrap_or_else(|| panic!("no {kind} {name}"))
}

/// The one container of a workload's pod template.
fn container(workload: &Value) -> &Value {
    let containers = list_at(workload, "/spec/template/spec/containers");
    assert_eq!(containers.len(), 1, "one container expected in {workload}");
    &containers[0]
}

fn args(container: &Value) -> Vec<&str> {
    list_at(container, "/args").iter().map(|a| a.as_str().expect("args are strings")).collect()
}

/// The value following `flag` in `args`.
fn flag<'a>(args: &[&'a str], flag: &str) -> Option<&'a str> {
    args.iter().position(|a| *a == flag).and_then(|i| args.get(i + 1).copied())
}

#[test]
fn every_manifest_is_valid_and_the_kinds_are_the_expected_ones() {
    let files = manifests();
    let names: Vec<&str> =
        files.iter().map(|f| f.file_name().and_then(|n| n.to_str()).expect("a UTF-8 file name")).collect();
    let (output, stdout) = validate(&root().join("deploy/kubernetes"), &names);
    assert!(
        output.status.success(),
        "kubernetes-validate failed ({}):\n{stdout}{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    // A kind without a schema is only a warning: it was not validated.
    let complaints: Vec<&str> = stdout.lines().filter(|l| !l.starts_with("INFO ")).collect();
    assert!(complaints.is_empty(), "kubernetes-validate complained:\n{}", complaints.join("\n"));

    // "INFO <file> passed for resource <kind>/<name> against version 1.29"
    let mut passed: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for line in stdout.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        assert!(
            words.len() == 9 && words[2] == "passed" && words[8] == "1.29",
            "unexpected line from kubernetes-validate: {line}"
        );
        passed.entry(words[1].to_string()).or_default().insert(words[5].to_string());
    }
    for (file, name) in files.iter().zip(&names) {
        let docs = documents(file).len();
        let validated = passed.get(*name).map_or(0, BTreeSet::len);
        assert_eq!(validated, docs, "{name}: {docs} objects but {validated} validated");
    }
    let kinds: BTreeSet<&str> =
        passed.values().flatten().filter_map(|resource| resource.split('/').next()).collect();
    let expected: BTreeSet<&str> =
        ["configmap", "secret", "deployment", "statefulset", "service", "persistentvolumeclaim", "job"]
            .into_iter()
            .collect();
    assert_eq!(kinds, expected);
}

#[test]
fn the_validator_rejects_broken_manifests() {
    let master = read(&root().join("deploy/kubernetes/master.yaml"));
    assert!(master.contains("\n  replicas: 2\n"), "master.yaml no longer says `replicas: 2`");
    let dir = tempfile::tempdir().expect("a temporary directory");
    let cases = [
        ("wrong-type.yaml", master.replace("\n  replicas: 2\n", "\n  replicas: \"two\"\n"), "replicas"),
        // Strict validation: an unknown field is an error, not ignored.
        ("unknown-field.yaml", master.replace("\n  replicas: 2\n", "\n  replica: 2\n"), "replica"),
    ];
    for (name, text, needle) in cases {
        std::fs::write(dir.path().join(name), text).expect("write a broken manifest");
        let (output, stdout) = validate(dir.path(), &[name]);
        assert!(!output.status.success(), "{name} passed:\n{stdout}");
        assert!(stdout.contains("ERROR") && stdout.contains(needle), "{name}: {stdout}");
    }
    // A kind it has no schema for is a warning, which the test above counts as a failure.
    let name = "unknown-kind.yaml";
    std::fs::write(dir.path().join(name), "apiVersion: v1\nkind: Frobnicator\nmetadata:\n  name: x\n")
        .expect("write a manifest");
    let (_, stdout) = validate(dir.path(), &[name]);
    assert!(stdout.starts_with("WARN "), "{stdout}");
}

#[test]
fn master_and_pservers_listen_on_the_pod_ip() {
    let objects = objects();
    for (kind, name) in [("Deployment", "oar-master"), ("StatefulSet", "oar-pserver")] {
        let c = container(object(&objects, kind, name));
        // The address bound is the one published in etcd: it must be reachable from other pods.
        assert_eq!(flag(&args(c), "--listen"), Some("$(POD_IP):7000"), "{kind} {name}");
        let pod_ip = list_at(c, "/env").iter().find(|e| e["name"] == "POD_IP");
        assert_eq!(
            pod_ip.and_then(|e| e.pointer("/valueFrom/fieldRef/fieldPath")).and_then(Value::as_str),
            Some("status.podIP"),
            "{kind} {name}: POD_IP from the downward API"
        );
        let ports = list_at(c, "/ports");
        assert!(
            ports.iter().any(|p| p["containerPort"] == 7000 && p["protocol"] == "UDP"),
            "{kind} {name}: QUIC is UDP on 7000: {ports:?}"
        );
    }
}

/// The long flags of the fields marked `#[arg(...)]` in `struct NAME { ... }` of `src`.
fn struct_flags(src: &str, name: &str) -> BTreeSet<String> {
    let mut lines = src.lines().skip_while(|l| !l.trim_start().ends_with(&format!("struct {name} {{")));
    assert!(lines.next().is_some(), "no struct {name}");
    let mut flags = BTreeSet::new();
    let mut is_arg = false;
    for line in lines.map(str::trim).take_while(|l| *l != "}") {
        if line.starts_with("#[arg") {
            is_arg = true;
        } else if line.starts_with("#[command") {
            is_arg = false;
        } else if let Some((field, _)) = line.strip_prefix("pub ").unwrap_or(line).split_once(':') {
            if is_arg && !field.starts_with("//") {
                flags.insert(format!("--{}", field.replace('_', "-")));
            }
            is_arg = false;
        }
    }
    flags
}

#[test]
fn the_manifests_agree_with_each_other_and_with_the_binaries() {
    let objects = objects();
    let examples = root().join("examples");
    let common = read(&examples.join("common/mod.rs"));
    let conn = struct_flags(&common, "ConnArgs");
    assert!(conn.contains("--etcd") && conn.contains("--listen"), "ConnArgs flags: {conn:?}");
    let with = |more: BTreeSet<String>| conn.union(&more).cloned().collect::<BTreeSet<String>>();
    let flags: BTreeMap<&str, BTreeSet<String>> = [
        ("master", with(struct_flags(&common, "JobArgs"))),
        ("pserver", with(struct_flags(&read(&examples.join("pserver.rs")), "Args"))),
        ("trainer", with(struct_flags(&read(&examples.join("trainer.rs")), "Args"))),
    ]
    .into_iter()
    .collect();
    assert!(flags["master"].contains("--test-data") && flags["pserver"].contains("--checkpoint-dir"));

    let config = object(&objects, "ConfigMap", "oar-job");
    let secret = object(&objects, "Secret", "oar-certs");
    let dockerfile = read(&root().join("deploy/Dockerfile"));
    let workloads = [("Deployment", "oar-master"), ("StatefulSet", "oar-pserver"), ("Job", "oar-trainer")];
    for (kind, name) in workloads {
        let workload = object(&objects, kind, name);
        let c = container(workload);
        let role = str_at(c, "/command/0");
        let args = args(c);
        assert!(dockerfile.contains(role), "the Dockerfile does not install {role}");
        for arg in args.iter().filter(|a| a.starts_with("--")) {
            assert!(flags[role].contains(*arg), "{kind} {name}: {role} has no flag {arg}");
        }
        // Every $(VAR) must be defined, or Kubernetes passes it on literally.
        let mut defined: BTreeSet<&str> = list_at(c, "/env").iter().map(|e| str_at(e, "/name")).collect();
        for source in list_at(c, "/envFrom") {
            assert_eq!(str_at(source, "/configMapRef/name"), "oar-job", "{kind} {name}");
            defined
                .extend(at(config, "/data").as_object().expect("ConfigMap data").keys().map(String::as_str));
        }
        for arg in &args {
            for var in arg.split("$(").skip(1).filter_map(|rest| rest.split_once(')')).map(|(v, _)| v) {
                assert!(defined.contains(var), "{kind} {name}: $({var}) is not defined");
            }
        }
        // The certificates come from the Secret, and exist in it.
        for volume in list_at(workload, "/spec/template/spec/volumes") {
            if let Some(items) = volume.pointer("/secret/items").and_then(Value::as_array) {
                assert_eq!(str_at(volume, "/secret/secretName"), "oar-certs");
                for item in items {
                    let key = str_at(item, "/key");
                    let found = ["stringData", "data"]
                        .iter()
                        .any(|d| secret.pointer(&format!("/{d}/{key}")).is_some());
                    assert!(found, "no {key} in oar-certs");
                }
            }
        }
        for (f, file) in [
            ("--ca", "ca.pem".to_string()),
            ("--cert", format!("{role}.pem")),
            ("--key", format!("{role}.key")),
        ] {
            assert_eq!(flag(&args, f), Some(format!("/etc/oar/certs/{file}").as_str()), "{kind} {name}");
        }
    }

    // One active master and one standby.
    let master = object(&objects, "Deployment", "oar-master");
    assert_eq!(at(master, "/spec/replicas"), 2);
    // One pod per pserver of the job: the first shard map waits for the
    // master's --pservers of them.
    assert_eq!(flag(&args(container(master)), "--pservers"), Some("$(PSERVERS)"));
    let pservers = object(&objects, "StatefulSet", "oar-pserver");
    let wanted: u64 = str_at(config, "/data/PSERVERS").parse().expect("PSERVERS is a number");
    assert_eq!(at(pservers, "/spec/replicas"), wanted, "pserver StatefulSet replicas != PSERVERS");
    // Each shard's replicas are on distinct pservers: at most PSERVERS of them.
    assert_eq!(flag(&args(container(master)), "--replicas"), Some("$(REPLICAS)"));
    let replicas: u64 = str_at(config, "/data/REPLICAS").parse().expect("REPLICAS is a number");
    assert!((1..=wanted).contains(&replicas), "REPLICAS {replicas} is not from 1 to PSERVERS {wanted}");
    assert_eq!(flag(&args(container(master)), "--shards"), Some("$(SHARDS)"));
    let shards: u64 = str_at(config, "/data/SHARDS").parse().expect("SHARDS is a number");
    assert!(shards >= 1, "no shards");
    // A StatefulSet for the order of its pod names (a scale-in drains the
    // highest-numbered pservers, which the StatefulSet then removes), with
    // its governing headless Service; pods start and stop all at once.
    assert_eq!(str_at(pservers, "/spec/serviceName"), "oar-pserver");
    assert_eq!(str_at(pservers, "/spec/podManagementPolicy"), "Parallel");
    let service = object(&objects, "Service", "oar-pserver");
    assert_eq!(str_at(service, "/spec/clusterIP"), "None", "a headless Service");
    assert_eq!(at(service, "/spec/selector"), at(pservers, "/spec/selector/matchLabels"));
    // Pods are not tied to a shard: nothing passes a pod's ordinal.
    let c = container(pservers);
    for env in list_at(c, "/env") {
        let field = env.pointer("/valueFrom/fieldRef/fieldPath").and_then(Value::as_str).unwrap_or("");
        assert!(!field.contains("pod-index"), "the pservers get a pod index: {env}");
    }
    // Every pserver reads and writes the same checkpoint directory: a shard's
    // checkpoints are restored by whichever pserver takes the shard over.
    let dir = flag(&args(c), "--checkpoint-dir").expect("the pservers have a --checkpoint-dir");
    assert_eq!(dir, "/var/lib/oar");
    let mounts: Vec<&Value> = list_at(c, "/volumeMounts").iter().filter(|m| m["mountPath"] == dir).collect();
    assert_eq!(mounts.len(), 1, "one volume mounted at the pservers' --checkpoint-dir {dir}: {mounts:?}");
    assert_ne!(mounts[0].get("readOnly"), Some(&Value::Bool(true)), "{dir} is mounted read-only");
    assert!(
        mounts[0].get("subPath").is_none() && mounts[0].get("subPathExpr").is_none(),
        "{dir}: a subpath, which can differ between pods"
    );
    let volume_name = str_at(mounts[0], "/name");
    let volume = list_at(pservers, "/spec/template/spec/volumes")
        .iter()
        .find(|v| v["name"] == volume_name)
        .unwrap_or_else(|| panic!("no volume {volume_name} in the pservers' pod"));
    let claim = volume
        .pointer("/persistentVolumeClaim/claimName")
        .and_then(Value::as_str)
        .unwrap_or_else(|| panic!("the pservers' {dir} is not a PersistentVolumeClaim: {volume}"));
    // Mounted by every pserver pod at once, wherever it runs.
    let claim = object(&objects, "PersistentVolumeClaim", claim);
    assert_eq!(at(claim, "/spec/accessModes"), &serde_json::json!(["ReadWriteMany"]), "{claim}");
    // Trainers run to completion.
    let trainers = object(&objects, "Job", "oar-trainer");
    assert_eq!(
        (at(trainers, "/spec/parallelism"), at(trainers, "/spec/completions")),
        (&3.into(), &3.into())
    );
}
