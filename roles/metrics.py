"""Optional Prometheus metrics for the controller (``pip install prometheus-client``)."""

from __future__ import annotations

from weightsync.engine.errors import ConfigError

from .round_state import RoundReport


WORK = (("encode", "sender_encode_max"), ("apply", "receiver_apply_max"), ("verify", "receiver_verify_max"))


class Metrics:
    """Counters and histograms of update rounds, served over HTTP on ``port``."""

    def __init__(self, port: int, addr: str = "127.0.0.1") -> None:
        try:
            import prometheus_client as prom
        except ImportError as exc:
            raise ConfigError("metrics", "prometheus-client is not installed (pip install prometheus-client)") from exc
        self.registry = prom.CollectorRegistry()
        self.rounds = prom.Counter("weightsync_rounds", "Update rounds by outcome", ["outcome"], registry=self.registry)
        self.bytes = prom.Counter("weightsync_bytes", "Bytes moved by committed rounds", registry=self.registry)
        self.seconds = prom.Histogram("weightsync_round_seconds", "Round time, begin to commit acknowledged",
                                      buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60), registry=self.registry)
        self.stage = prom.Histogram("weightsync_stage_seconds", "Round stages (gate, transfer, fence, commit) and the work "
                                    "in them: encode (deltas, the busiest sender), apply (deltas) and verify "
                                    "(checksums; the busiest receiver)", ["stage"], registry=self.registry)
        self.version = prom.Gauge("weightsync_committed_version", "Last committed version", registry=self.registry)
        self.whole = prom.Counter("weightsync_whole_bytes", "Bytes committed rounds' rows are whole (delta rounds "
                                  "move fewer: weightsync_bytes)", registry=self.registry)
        self.delta_rows = prom.Counter("weightsync_delta_rows", "Rows that went as deltas", registry=self.registry)
        self.changed = prom.Counter("weightsync_changed_values", "Values the deltas changed", registry=self.registry)
        self.armed = prom.Counter("weightsync_armed_rounds", "Committed rounds whose senders wrote on their own push, "
                                  "under an arm (docs/PROTOCOL.md, Armed pushes)", registry=self.registry)
        self.predicted = prom.Gauge("weightsync_round_predicted_seconds", "The controller's prediction of the last "
                                    "committed round, made before it (learned costs; 0: none yet)", registry=self.registry)
        self.link = prom.Gauge("weightsync_link_gbps", "GB/s of the last round per link", ["sender", "receiver"],
                               registry=self.registry)
        prom.start_http_server(port, addr=addr, registry=self.registry)

    def observe(self, report: RoundReport) -> None:
        self.rounds.labels("committed" if report.ok else "aborted").inc()
        if not report.ok:
            return
        self.bytes.inc(report.nbytes)
        self.whole.inc(report.whole_bytes)
        self.delta_rows.inc(report.delta_rows)
        self.changed.inc(report.changed_values)
        self.armed.inc(1 if report.armed else 0)
        self.seconds.observe(report.seconds)
        self.predicted.set(report.predicted_s)
        for stage in ("gate", "transfer", "fence", "commit"):
            if stage in report.stages:
                self.stage.labels(stage).observe(report.stages[stage])
        for stage, key in WORK:  # (the busiest sender's or receiver's, as it reported)
            if report.stages.get(key):
                self.stage.labels(stage).observe(report.stages[key])
        self.version.set(report.version)
        for link in report.links:
            self.link.labels(str(link.sender), str(link.receiver)).set(link.gbps)
