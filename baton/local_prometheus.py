"""`baton serve --prometheus`: a Prometheus on this machine that scrapes what serve started.

It runs the `prometheus` binary on PATH with a config written for this run: static targets for
the router and every engine, labelled as the operator's PodMonitor labels its pods (`namespace`,
`pod`, `pool`, `inference_service`; engines also get their `role`), so the chart's dashboard,
alert rules (`charts/baton/rules/*.yaml`, loaded when this is a source checkout) and autoscaling
queries run unchanged against real numbers on a laptop. Config and storage live in a temp dir
that goes with the run.
"""

from __future__ import annotations

import argparse
import re
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import yaml

DEFAULT_PORT = 9090
DEFAULT_SCRAPE_INTERVAL = "5s"
ROUTER_JOB = "baton-router"
ENGINE_JOB = "baton-engine"
NAMESPACE = "local"  # the `namespace` label of every target
SERVICE = "local"  # the `inference_service` label of every target
# The chart's rules, found from the package: present in a source checkout, not in the image.
RULES_DIR = Path(__file__).resolve().parents[1] / "charts" / "baton" / "rules"
# The operator names each engine pool (its Deployment's component) after the role, but for
# aggregated engines (role both), whose pool is "engine"; `baton serve` names its engines so.
ROLE_OF_POOL = {"prefill": "prefill", "decode": "decode", "engine": "both"}
# Prometheus's own duration syntax (its model.ParseDuration), units largest first.
_DURATION = re.compile(r"(\d+y)?(\d+w)?(\d+d)?(\d+h)?(\d+m)?(\d+s)?(\d+ms)?")
_MISSING = (
    "--prometheus needs the `prometheus` binary on PATH: `apt-get install prometheus` "
    "(Debian, Ubuntu), or the release archive from https://prometheus.io/download/"
)


class EngineTarget(NamedTuple):
    """One engine to scrape: its host:port, its name (the `pod` label) and its pool."""

    address: str
    name: str
    pool: str  # prefill, decode or engine (role both), as the operator names pools


@dataclass(frozen=True)
class PrometheusConfig:
    """Where the local Prometheus listens (127.0.0.1) and how often it scrapes."""

    port: int = DEFAULT_PORT
    scrape_interval: str = DEFAULT_SCRAPE_INTERVAL  # a Prometheus duration: 5s, 500ms, 1m

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"--prometheus port must be 1-65535, got {self.port}")
        interval = self.scrape_interval
        if not _DURATION.fullmatch(interval) or not any(map(int, re.findall(r"\d+", interval))):
            raise ValueError(
                f"--prometheus-scrape-interval must be a Prometheus duration above zero "
                f"such as 5s, 500ms or 1m, got {interval!r}"
            )


def add_prometheus_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prometheus",
        type=int,
        nargs="?",
        const=DEFAULT_PORT,
        default=None,
        metavar="PORT",
        help=f"also run a local Prometheus (the `prometheus` binary on PATH) on 127.0.0.1:PORT "
        f"(default {DEFAULT_PORT}) that scrapes the router and the engines",
    )
    parser.add_argument(
        "--prometheus-scrape-interval",
        default=DEFAULT_SCRAPE_INTERVAL,
        metavar="DURATION",
        help=f"how often it scrapes and evaluates rules (default {DEFAULT_SCRAPE_INTERVAL})",
    )


def prometheus_from_args(args: argparse.Namespace) -> PrometheusConfig | None:
    """The config `--prometheus` asks for; None without it."""
    if args.prometheus is None:
        return None
    return PrometheusConfig(args.prometheus, args.prometheus_scrape_interval)


def scrape_config(
    router: str, engines: Sequence[EngineTarget], interval: str, rule_files: Sequence[Path]
) -> dict[str, Any]:
    """The Prometheus config: the `router` (host:port) and `engines` scraped every `interval`
    (also the rules' evaluation interval), with `rule_files` loaded.

    The engine job honours the engines' own labels: `baton:engine_info` has a `role` label of
    its own, equal to the target's, which would otherwise be renamed `exported_role`."""
    common = {"namespace": NAMESPACE, "inference_service": SERVICE}
    router_target = {"targets": [router], "labels": {**common, "pod": "router", "pool": "router"}}
    engine_targets = [
        {
            "targets": [e.address],
            "labels": {**common, "pod": e.name, "pool": e.pool, "role": ROLE_OF_POOL[e.pool]},
        }
        for e in engines
    ]
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": [str(path) for path in rule_files],
        "scrape_configs": [
            {"job_name": ROUTER_JOB, "static_configs": [router_target]},
            {"job_name": ENGINE_JOB, "honor_labels": True, "static_configs": engine_targets},
        ],
    }


class LocalPrometheus:
    """One run's Prometheus: its command line, and the temp dir with its config and storage
    that `cleanup()` removes. The process itself is started and stopped by `baton serve`."""

    def __init__(self, config: PrometheusConfig) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            raise FileNotFoundError(_MISSING)
        self.binary = binary
        self.config = config
        self.url = f"http://127.0.0.1:{config.port}"
        self.rule_files = sorted(RULES_DIR.glob("*.yaml"))
        self.dir: Path | None = None  # made by `command`
        self.num_targets = 0

    @property
    def config_file(self) -> Path | None:
        return None if self.dir is None else self.dir / "prometheus.yml"

    def command(self, router: str, engines: Sequence[EngineTarget]) -> list[str]:
        """Writes the config for the `router` (host:port) and `engines` into a new temp dir
        and returns the command that runs Prometheus on it."""
        self.dir = Path(tempfile.mkdtemp(prefix="baton-prometheus-"))
        config = scrape_config(router, engines, self.config.scrape_interval, self.rule_files)
        config_file = self.dir / "prometheus.yml"
        config_file.write_text(yaml.safe_dump(config, sort_keys=False))
        self.num_targets = 1 + len(engines)
        return [
            self.binary,
            f"--config.file={config_file}",
            f"--storage.tsdb.path={self.dir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.config.port}",
            # Its start-up chatter at info level would bury the engines' own logs.
            "--log.level=warn",
        ]

    def summary(self) -> str:
        """One line for serve's banner: where it is and what it scrapes."""
        rules = f", rules {', '.join(p.name for p in self.rule_files)}" if self.rule_files else ""
        return (
            f"Prometheus: {self.url} scrapes {self.num_targets} targets every "
            f"{self.config.scrape_interval}{rules} (config {self.config_file})"
        )

    def cleanup(self) -> None:
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
