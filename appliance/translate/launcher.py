"""Which engine a command launches, and the engine's own arguments: wrappers (nohup, env, uv run, docker run,
bash -c) are taken off, `docker run` options are kept as a report (ports, mounts, GPUs, environment)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

# docker run options that take a value (everything else that starts with `-` is a switch)
_DOCKER_VALUED = {
    "-a", "--attach", "--add-host", "--annotation", "--blkio-weight", "--cap-add", "--cap-drop", "--cgroup-parent",
    "--cgroupns", "--cidfile", "--cpu-period", "--cpu-quota", "-c", "--cpu-shares", "--cpus", "--cpuset-cpus",
    "--cpuset-mems", "--device", "--device-cgroup-rule", "--dns", "--dns-option", "--dns-search", "--domainname",
    "--entrypoint", "-e", "--env", "--env-file", "--expose", "--gpus", "--group-add", "--health-cmd",
    "--health-interval", "--health-retries", "--health-start-period", "--health-timeout", "-h", "--hostname",
    "--ip", "--ip6", "--ipc", "--isolation", "--kernel-memory", "-l", "--label", "--label-file", "--link",
    "--log-driver", "--log-opt", "--mac-address", "-m", "--memory", "--memory-reservation", "--memory-swap",
    "--mount", "--name", "--network", "--net", "--network-alias", "--pid", "--pids-limit", "--platform", "-p",
    "--publish", "--pull", "--restart", "--runtime", "--security-opt", "--shm-size", "--stop-signal",
    "--stop-timeout", "--storage-opt", "--sysctl", "--tmpfs", "--ulimit", "-u", "--user", "--userns", "--uts",
    "-v", "--volume", "--volumes-from", "-w", "--workdir",
}
# images whose entrypoint is the engine, so the words after the image are engine arguments
_IMAGE_ENTRYPOINTS = ((re.compile(r"vllm[-/]?openai|vllm/vllm"), ("vllm", "serve")),
                      (re.compile(r"atlas"), ("spark",)))
_CONTAINER_VALUED = {"-B", "--bind", "--env", "--home", "-H", "--overlay", "-o", "--pwd", "-W", "--workdir"}
_WRAPPERS = {"nohup", "exec", "time", "stdbuf", "setsid", "nice", "ionice", "taskset", "numactl", "srun"}
_PYTHON = re.compile(r"(.*/)?python(\d(\.\d+)?)?$")
_SHELLS = re.compile(r"(.*/)?(ba|z|da)?sh$")


@dataclass
class Launch:
    """One engine invocation found in a command."""

    engine: str | None  # vllm / sglang / tokenspeed / atlas; None: not an engine command
    args: list[str]  # the engine's own arguments
    positional_model: bool = True  # whether a bare word is the model (`vllm serve MODEL`, not api_server)
    env: dict[str, str] = field(default_factory=dict)  # docker -e variables (command env is added by the caller)
    docker: list[str] = field(default_factory=list)  # report lines about the container
    devices: list[str] | None = None  # GPUs from docker --gpus
    script: str | None = None  # `bash -c SCRIPT`: the caller parses this instead


def _strip_wrappers(argv: list[str], env: dict[str, str]) -> list[str]:
    while argv:
        head = argv[0].rsplit("/", 1)[-1]
        if head in _WRAPPERS:
            argv = argv[1:]
            while argv and argv[0].startswith("-"):  # options of the wrapper (numactl --interleave=all ...)
                argv = argv[1:]
        elif head == "sudo":
            argv = argv[1:]
            while argv and argv[0].startswith("-"):
                argv = argv[1:]
        elif head == "env":
            argv = argv[1:]
            while argv and ("=" in argv[0] or argv[0].startswith("-")):
                if "=" in argv[0] and not argv[0].startswith("-"):
                    k, _, v = argv[0].partition("=")
                    env[k] = v
                argv = argv[1:]
        elif head in ("uv", "poetry", "pipenv", "pdm", "rye", "pipx", "hatch") and argv[1:2] == ["run"] \
                or head == "uvx":
            argv = argv[1:] if head == "uvx" else argv[2:]
            while argv and argv[0].startswith("-"):
                argv = argv[1:]
        elif head in ("apptainer", "singularity") and argv[1:2] in (["exec"], ["run"]):
            argv = argv[2:]  # [options] IMAGE COMMAND...
            while argv and argv[0].startswith("-"):
                argv = argv[2:] if argv[0] in _CONTAINER_VALUED else argv[1:]
            argv = argv[1:]
        elif "--" in argv and head in ("kubectl", "oc", "ray", "mpirun", "launch", "env"):
            argv = argv[argv.index("--") + 1:]  # `kubectl exec POD -- CMD`, `ray job submit -- CMD`
        elif head == "conda" and argv[1:2] == ["run"]:
            argv = argv[2:]
            while argv and argv[0].startswith("-"):
                argv = argv[2:] if argv[0] in ("-n", "--name", "-p", "--prefix") else argv[1:]
        else:
            return argv
    return argv


def _docker(argv: list[str]) -> Launch:
    """`docker run [OPTIONS] IMAGE [COMMAND...]`: the command, plus what the container setup means."""
    i, report, env, devices, entrypoint = 2 if argv[1] == "run" else 3, [], {}, None, None
    while i < len(argv) and argv[i].startswith("-"):
        opt, eq, val = argv[i].partition("=")
        if not eq and opt in _DOCKER_VALUED:
            val, i = (argv[i + 1] if i + 1 < len(argv) else ""), i + 1
        elif not eq and len(opt) > 2 and not opt.startswith("--") and opt[:2] in _DOCKER_VALUED:
            opt, val = opt[:2], opt[2:]  # -p8000:8000
        i += 1
        if opt in ("-p", "--publish"):
            report.append(f"port map {val} (host:container); api.port is the container side")
        elif opt in ("-v", "--volume", "--mount"):
            report.append(f"mount {val}: paths in the config are the container's")
        elif opt in ("-e", "--env"):
            k, has, v = val.partition("=")
            env[k] = v if has else f"${k}"  # `-e NAME` passes the host's value through: unresolved here
        elif opt == "--gpus":
            spec = val.strip("'\"")
            m = re.search(r"device=([\d,]+)", spec)
            devices = m.group(1).split(",") if m else None
            report.append(f"GPUs: --gpus {spec}")
        elif opt == "--entrypoint":
            entrypoint = val
        elif opt in ("--ipc", "--shm-size", "--network", "--net"):
            report.append(f"{opt} {val} (container setting, kept outside the config)")
        elif opt == "--env-file":
            report.append(f"--env-file {val}: its variables are not read by the translator")
    image, rest = (argv[i], argv[i + 1:]) if i < len(argv) else ("", [])
    report.insert(0, f"docker image {image}")
    if entrypoint:
        rest = [entrypoint, *rest]
    elif not rest or rest[0].startswith("-") or not _looks_like_program(rest[0]):
        for pattern, entry in _IMAGE_ENTRYPOINTS:
            if pattern.search(image):
                rest = [*entry, *rest]
                break
    inner = detect(rest, env)
    inner.docker = report + inner.docker
    inner.env = {**env, **inner.env}
    inner.devices = devices or inner.devices
    return inner


def _looks_like_program(word: str) -> bool:
    return bool(_PYTHON.match(word) or _SHELLS.match(word)) or word in ("vllm", "sglang", "tokenspeed", "ts",
                                                                         "spark")


def detect(argv: list[str] | tuple[str, ...], env: dict[str, str] | None = None) -> Launch:
    """The engine a command starts (engine None when it is some other command)."""
    env = {} if env is None else env
    argv = _strip_wrappers(list(argv), env)
    if not argv:
        return Launch(None, [])
    head = argv[0].rsplit("/", 1)[-1]
    if head in ("docker", "podman", "nvidia-docker") and argv[1:2] == ["run"] or argv[1:3] == ["container", "run"]:
        return _docker(argv)
    if _SHELLS.match(head) and "-c" in argv[1:3]:
        at = argv.index("-c")
        return Launch(None, [], script=argv[at + 1] if at + 1 < len(argv) else "")
    if head == "vllm" and argv[1:2] == ["serve"]:
        return Launch("vllm", argv[2:], env=env)
    if head == "sglang" and argv[1:2] == ["serve"]:
        return Launch("sglang", argv[2:], positional_model=False, env=env)
    if head in ("tokenspeed", "ts") and argv[1:2] == ["serve"]:
        return Launch("tokenspeed", argv[2:], env=env)
    if head == "spark" and argv[1:2] == ["serve"]:
        return Launch("atlas", argv[2:], env=env)
    if head == "torchrun" or head == "deepspeed":  # `torchrun [options] -m MODULE ARGS` runs a python module
        rest = argv[1:]
        while rest and rest[0] != "-m" and rest[0].startswith("-"):
            rest = rest[1:] if "=" in rest[0] or rest[1:2] == ["-m"] else rest[2:]
        argv = ["python", *rest]
        head = "python"
    if _PYTHON.match(head):
        rest = argv[1:]
        while rest and rest[0] in ("-u", "-O", "-B", "-E", "-s"):
            rest = rest[1:]
        if rest[:1] == ["-m"] and len(rest) > 1:
            module, args = rest[1], rest[2:]
            if module == "vllm.entrypoints.openai.api_server":
                return Launch("vllm", args, positional_model=False, env=env)
            if module == "vllm.entrypoints.cli.main" and args[:1] == ["serve"]:
                return Launch("vllm", args[1:], env=env)
            if module in ("sglang.launch_server", "sglang.srt.server", "sglang_router.launch_server"):
                # the router launcher starts dp workers behind SGLang's router: the same server arguments, plus
                # `--router-*` options (tables/sglang.py); the appliance routes among its dp replicas itself
                return Launch("sglang", args, positional_model=False, env=env)
            if module.startswith("tokenspeed") and "serve" in args[:1]:
                return Launch("tokenspeed", args[1:], env=env)
    return Launch(None, [])
