"""The team configuration on real services (scripts/services.sh): Postgres for the Dagster instance and
MLflow's backend store, moto's S3 server for artifacts and MLflow's artifacts, the MLflow tracking
server, dagster-daemon and the webserver, all on 127.0.0.1. Runs are launched through the webserver's
GraphQL API (queued, then launched by the daemon) or by `dagster job execute` on the same instance."""

import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import requests

from vlm_assets.launch.local import alive
from vlm_assets_tests.conftest import free_port
from vlm_assets_tests.waiting import wait_until

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
REPOSITORY = {"repositoryLocationName": "vlm_assets", "repositoryName": "__repository__"}
LAUNCH = """mutation($params: ExecutionParams!) { launchRun(executionParams: $params) {
  __typename ... on LaunchRunSuccess { run { runId } } ... on PythonError { message }
  ... on RunConfigValidationInvalid { errors { message } } } }"""
STATUS = """query($runId: ID!) { runOrError(runId: $runId) { ... on Run { status } } }"""
START_SCHEDULE = """mutation($selector: ScheduleSelector!) { startSchedule(scheduleSelector: $selector) {
  __typename ... on ScheduleStateResult { scheduleState { id } } ... on PythonError { message } } }"""
STOP_SCHEDULE = """mutation($id: String!) { stopRunningSchedule(id: $id) {
  __typename ... on ScheduleStateResult { scheduleState { status } } ... on PythonError { message } } }"""


class Team:
    def __init__(self, root: Path, env: dict[str, str]):
        self.root, self.env = root, env
        self.url = env["VLM_SERVICES_WEBSERVER"]

    def graphql(self, query: str, **variables):
        response = requests.post(f"{self.url}/graphql", json={"query": query, "variables": variables}, timeout=60)
        response.raise_for_status()
        body = response.json()
        assert "errors" not in body, body
        return body["data"]

    def launch(self, job: str, run_config: dict | None = None) -> str:
        params = {"selector": {**REPOSITORY, "jobName": job}, "runConfigData": run_config or {}}
        launched = self.graphql(LAUNCH, params=params)["launchRun"]
        assert launched["__typename"] == "LaunchRunSuccess", launched
        return launched["run"]["runId"]

    def status(self, run_id: str) -> str:
        return self.graphql(STATUS, runId=run_id)["runOrError"]["status"]

    def wait_for_end(self, run_id: str) -> str:
        return wait_until(
            lambda: (s := self.status(run_id)) in ("SUCCESS", "FAILURE", "CANCELED") and s,
            f"run {run_id} to end",
            timeout=1200,
            every=2,
        )

    def failure(self, run_id: str) -> str:
        """What to read when a run did not do what a test expected: its status, errors and the daemon's log."""
        import dagster as dg

        records = (
            self.instance()
            .get_records_for_run(
                run_id,
                of_type={
                    dg.DagsterEventType.STEP_FAILURE,
                    dg.DagsterEventType.RUN_FAILURE,
                    dg.DagsterEventType.ENGINE_EVENT,
                },
            )
            .records
        )
        errors = [r.event_log_entry.message for r in records][-10:]
        daemon = (self.root / "logs" / "daemon.log").read_text()[-3000:]
        return f"run {run_id}: {self.status(run_id)}\n" + "\n".join(errors) + f"\n--- daemon log\n{daemon}"

    def instance(self):
        import dagster as dg

        with pytest.MonkeyPatch.context() as mp:
            for k, v in self.env.items():
                mp.setenv(k, v)
            return dg.DagsterInstance.from_config(self.env["DAGSTER_HOME"])

    def run(self, *args: str, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "dagster", *args],
            cwd=REPO,
            env={**os.environ, **self.env, **env},
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def service_pid(self, name: str) -> int:
        for line in (self.root / "pids").read_text().splitlines():
            if line.split()[0] == name:
                return int(line.split()[1])
        raise KeyError(name)


@pytest.fixture(scope="module")
def team(offline_data):
    # Postgres does not run as root: its directory must be reachable by the postgres user.
    root = Path(tempfile.mkdtemp(prefix="vlm-team-", dir="/var/tmp"))
    root.chmod(0o755)
    env = {
        **os.environ,
        "VLM_SERVICES_WEB_PORT": str(free_port()),
        "VLM_ASSETS_PROFILE": "demo",  # docs/operations.md's team setup (the in-process tests run "seed")
        # main_schedule every minute, so that a tick is seen within a test
        "VLM_ASSETS_SCHEDULE_CRON": "* * * * *",
        "VLM_ASSETS_SCHEDULE_JOB": "gpt_job",
    }
    up = subprocess.run(
        [str(REPO / "scripts" / "services.sh"), "up", str(root)], env=env, capture_output=True, text=True, timeout=600
    )
    try:
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        dump = subprocess.run(["bash", "-c", f"source {root}/env.sh && env -0"], capture_output=True, check=True).stdout
        after = dict(item.split("=", 1) for item in dump.decode().split("\0") if "=" in item)
        team_env = {k: v for k, v in after.items() if os.environ.get(k) != v and k not in ("SHLVL", "_", "PWD")}
        chosen = ("VLM_ASSETS_SCHEDULE_CRON", "VLM_ASSETS_SCHEDULE_JOB", "VLM_ASSETS_PROFILE")
        team_env.update({k: env[k] for k in chosen})
        yield Team(root, team_env)
    finally:
        pids = (
            [int(line.split()[1]) for line in (root / "pids").read_text().splitlines()]
            if (root / "pids").exists()
            else []
        )
        down = subprocess.run(
            [str(REPO / "scripts" / "services.sh"), "down", str(root)], capture_output=True, text=True
        )
        assert down.returncode == 0, down.stderr
        left = [pid for pid in pids if alive(pid)]
        listening = subprocess.run(["ss", "-ltnp"], capture_output=True, text=True).stdout
        subprocess.run(["rm", "-rf", str(root)])
        assert not left, f"services.sh down left {left}"
        assert "postgres" not in listening or str(root) not in listening


def test_everything_listens_on_loopback_only(team):
    listening = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout.splitlines()
    ports = {
        team.env["DAGSTER_PG_PORT"],
        team.env["AWS_ENDPOINT_URL"].rsplit(":", 1)[1],
        team.env["MLFLOW_TRACKING_URI"].rsplit(":", 1)[1],
        team.url.rsplit(":", 1)[1],
    }
    ours = [line.split()[3] for line in listening if line.split()[3].rsplit(":", 1)[1] in ports]
    assert len(ours) >= 4 and all(addr.startswith("127.0.0.1:") for addr in ours), ours


def _restart(team: Team, service: str, while_down: Callable[[], object]) -> None:
    """Stop a service's process group, call ``while_down``, start the service again with the same
    command and environment."""
    pid = team.service_pid(service)
    command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]
    environ = dict(e.split(b"=", 1) for e in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in e)
    os.killpg(pid, signal.SIGTERM)
    wait_until(lambda: not alive(pid), f"{service} to stop", every=0.2)
    while_down()
    with open(team.root / "logs" / f"{service}-restarted.log", "w") as log:
        restarted = subprocess.Popen(command, env=environ, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    with open(team.root / "pids", "a") as pids:  # `services.sh down` stops it
        pids.write(f"{service} {restarted.pid}\n")


def _training_windows(instance, run_ids: list[str]) -> list[tuple[float, float, str]]:
    """(start, end, run/step) of every step of the training pool in these runs."""
    import dagster as dg

    windows = []
    for run_id in run_ids:
        times = {}
        for record in instance.get_records_for_run(run_id).records:
            entry = record.event_log_entry
            if entry.is_dagster_event and entry.step_key in ("gpt_checkpoint", "visualchat_model", "occlusion_adapter"):
                times.setdefault(entry.step_key, {})[entry.dagster_event_type] = entry.timestamp
        for step, t in times.items():
            windows.append(
                (t[dg.DagsterEventType.STEP_START], t[dg.DagsterEventType.STEP_SUCCESS], f"{run_id[:8]}/{step}")
            )
    return sorted(windows)


@pytest.mark.timeout(3600)  # two gpt_jobs and a scheduled run, each bounded by wait_until on its own
def test_runs_at_once_share_the_pool_survive_an_mlflow_restart_and_the_schedule_reruns_from_cache(team):
    """Two gpt_jobs launched at once through the webserver (queued, launched by the daemon): the demo's
    and a shorter one of another seed (another key) on one node. Both run (the queue allows 4), both
    succeed, and their training steps never overlap (pool vlm_training, limit 1). The MLflow server is
    stopped while the first trains, until that run reports a step's metrics, then restarted: the MLflow
    client's retries carry those metrics over the gap, and its loss curve reaches S3 through the
    server's artifact proxy. Meanwhile main_schedule
    (every minute here, running gpt_job), started through the webserver, ticks under the daemon: its run
    waits for the pool and is a cache hit of the first run's key: it trains nothing.
    (main_job on the demo profile, registration included, is test_main_job's: on this deployment it
    would train the same models a second time in the suite.)"""
    import dagster as dg
    from mlflow import MlflowClient

    main = team.launch("gpt_job")
    other = team.launch(
        "gpt_job",
        {
            "ops": {
                "gpt_checkpoint": {
                    "config": {
                        "seed": 11,
                        "optimizer": {"max_steps": 10},
                        "data": {"val_check_interval": 10},
                        "checkpoint": {"every": 10},
                        "parallelism": {"num_nodes": 1},
                        "log_every": 5,
                    }
                }
            }
        },
    )
    instance = team.instance()

    seen, cursor = [], [None]

    def main_log() -> list:
        """The first run's event log entries so far (read incrementally)."""
        connection = instance.get_records_for_run(main, cursor=cursor[0])
        cursor[0] = connection.cursor
        seen.extend(r.event_log_entry for r in connection.records)
        return seen

    def main_steps(pattern: re.Pattern) -> list[int]:
        """The steps in the first run's log lines that ``pattern`` matches (the trainer's Pipes lines)."""
        return [int(m[1]) for e in main_log() if (m := pattern.match(e.user_message))]

    def main_training() -> bool:
        start = dg.DagsterEventType.STEP_START
        return any(e.step_key == "gpt_checkpoint" and e.dagster_event_type == start for e in main_log())

    def main_ended() -> bool:
        return team.status(main) in ("SUCCESS", "FAILURE", "CANCELED")

    # main_schedule starts once the first run holds the pool: its tick (at the next minute boundary)
    # then finds that run's token_shards built and its gpt_checkpoint ahead of it in the pool's queue,
    # and the wait for the tick overlaps the first run's training.
    wait_until(lambda: main_training() or main_ended(), "the first gpt_job to start training", timeout=1200, every=1)
    assert team.status(main) == "STARTED", team.failure(main)
    started = team.graphql(START_SCHEDULE, selector={**REPOSITORY, "scheduleName": "main_schedule"})["startSchedule"]
    assert started["__typename"] == "ScheduleStateResult", started
    try:
        committed = re.compile(r"checkpoint step (\d+) committed")  # the trainer's Pipes log lines
        wait_until(
            lambda: main_steps(committed) or main_ended(), "the first gpt_job to commit a checkpoint", timeout=1200
        )
        assert team.status(main) == "STARTED", team.failure(main)
        checkpoint = main_steps(committed)[0]
        # MLflow stays down until the trainer has reported a step's metrics after it was stopped: its Pipes
        # logger writes them before its MLflow logger sends them, which then waits out the gap (and holds
        # the next report back: `before` is read before the stop, not after it).
        metrics = re.compile(r"step (\d+): ")
        before = max([checkpoint, *main_steps(metrics)])

        def report_while_down() -> None:
            wait_until(
                lambda: max(main_steps(metrics), default=0) > before or main_ended(),
                f"the first gpt_job to report a step after {before} while MLflow is down",
                every=1,
            )
            assert max(main_steps(metrics)) > before, f"the first gpt_job ended without a report after step {before}"

        _restart(team, "mlflow", while_down=report_while_down)

        def scheduled_run():
            runs = instance.get_runs(filters=dg.RunsFilter(tags={"dagster/schedule_name": "main_schedule"}))
            return runs[0].run_id if runs else None

        scheduled = wait_until(scheduled_run, "a tick of main_schedule to launch a run", every=2)
    finally:
        stopped = team.graphql(STOP_SCHEDULE, id=started["scheduleState"]["id"])["stopRunningSchedule"]
        assert stopped["__typename"] == "ScheduleStateResult", stopped
    assert [team.wait_for_end(r) for r in (main, other)] == ["SUCCESS", "SUCCESS"], [
        team.failure(r) for r in (main, other)
    ]

    windows = _training_windows(instance, [main, other])
    assert len(windows) == 2, windows
    assert windows[0][1] <= windows[1][0], f"training steps held the pool at once: {windows}"
    stats = [instance.get_run_stats(r) for r in (main, other)]
    # both ran at once: the second started before the first ended (they waited on the pool, not the queue)
    assert max(s.start_time for s in stats) < min(s.end_time for s in stats), stats

    client = MlflowClient(team.env["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name("vlm_assets")
    gpt = client.search_runs(
        [experiment.experiment_id],
        filter_string=(f"tags.`dagster.asset` = 'gpt_checkpoint' and tags.`dagster.run_id` = '{main}'"),
    )
    assert [r.info.status for r in gpt] == ["FINISHED"]
    steps = [m.step for m in client.get_metric_history(gpt[0].info.run_id, "train/loss")]
    # every report reached the server, those of the gap too (log_every 10, 40 steps)
    assert sorted(set(steps)) == [10, 20, 30, 40], steps
    curve = Path(client.download_artifacts(gpt[0].info.run_id, "loss_curve.png", str(team.root)))
    assert curve.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import boto3

    s3 = boto3.client(
        "s3",
        endpoint_url=team.env["AWS_ENDPOINT_URL"],
        region_name="us-east-1",
        aws_access_key_id=team.env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=team.env["AWS_SECRET_ACCESS_KEY"],
    )
    stored = s3.list_objects_v2(Bucket=team.env["VLM_ASSETS_S3_BUCKET"], Prefix="mlflow/")
    assert any(o["Key"].endswith(f"{gpt[0].info.run_id}/artifacts/loss_curve.png") for o in stored.get("Contents", []))

    assert instance.get_run_by_id(scheduled).job_name == "gpt_job"
    assert team.wait_for_end(scheduled) == "SUCCESS", team.failure(scheduled)
    events = instance.get_records_for_run(scheduled, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION).records
    caches = {
        e.event_log_entry.dagster_event.asset_key.to_user_string(): getattr(
            v := e.event_log_entry.dagster_event.materialization.metadata.get("cache"), "value", v
        )
        for e in events
    }
    assert caches == {"token_shards": "hit", "gpt_checkpoint": "hit"}, caches


def test_postgres_unreachable_fails_naming_the_host(team):
    closed = str(free_port())
    run = team.run(
        "job", "execute", "-m", "vlm_assets.definitions", "-j", "gpt_job", timeout=300, DAGSTER_PG_PORT=closed
    )
    out = run.stdout + run.stderr
    assert run.returncode != 0
    assert f'connection to server at "127.0.0.1", port {closed} failed' in out, out[-3000:]


def test_instance_migrate_on_a_copy_keeps_every_run(team):
    """The upgrade path: `dagster instance migrate` (what services.sh runs at every `up`) on a copy of
    this instance's database, which stays readable with all its runs."""
    env = {**os.environ, **team.env, "PGPASSWORD": team.env["DAGSTER_PG_PASSWORD"]}
    pg = sorted(Path("/usr/lib/postgresql").glob("*/bin"))[-1]
    conn = ["-h", "127.0.0.1", "-p", team.env["DAGSTER_PG_PORT"], "-U", "vlm"]
    subprocess.run([pg / "createdb", *conn, "dagster_copy"], env=env, check=True)
    import dagster as dg

    @dg.asset
    def migrate_marker() -> int:
        return 1

    # a finished run of this test's own, whichever tests ran before it
    original = team.instance()
    marker = dg.materialize_to_memory([migrate_marker], instance=original).run_id
    # the runs as they stand before the dump: a run the daemon still launches moves on in the original
    before = {r.run_id: r for r in original.get_runs()}
    assert before[marker].status == dg.DagsterRunStatus.SUCCESS
    dump = subprocess.run([pg / "pg_dump", *conn, "dagster"], env=env, check=True, capture_output=True).stdout
    subprocess.run(
        [pg / "psql", *conn, "-q", "-d", "dagster_copy"], input=dump, env=env, check=True, capture_output=True
    )
    migrate = team.run("instance", "migrate", DAGSTER_PG_DB="dagster_copy")
    assert migrate.returncode == 0, migrate.stderr[-2000:]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DAGSTER_PG_DB", "dagster_copy")
        for k, v in team.env.items():
            if k != "DAGSTER_PG_DB":
                mp.setenv(k, v)
        copy = dg.DagsterInstance.from_config(team.env["DAGSTER_HOME"])
        copied = {r.run_id: r.status for r in copy.get_runs()}
        assert set(before) <= set(copied) and copied[marker] == dg.DagsterRunStatus.SUCCESS
        assert {i: copied[i] for i, r in before.items() if r.is_finished} == {
            i: r.status for i, r in before.items() if r.is_finished
        }


SHOUT = """
import mlflow
from mlflow.pyfunc import PythonModel


class Shout(PythonModel):
    def predict(self, context, model_input, params=None):
        return [text.upper() for text in model_input["text"]]


mlflow.models.set_model(Shout())
"""


def test_a_model_registers_through_the_tracking_server_and_its_champion_predicts(team, tmp_path, monkeypatch):
    """register_once through the team's MLflow server (Postgres backend store, artifacts proxied to S3):
    a version tagged with its weights, the champion alias, `models:/<name>@champion` loaded back through
    the server and predicting; the same weights again make no second version. A server, unlike a local
    store, refuses a version whose `models:/m-...` source comes without the logged model's id."""
    import mlflow
    import pandas as pd
    from mlflow.exceptions import MlflowException
    from mlflow.models import infer_signature

    from vlm_assets.models.registry import log_pyfunc, register_once

    uri = team.env["MLFLOW_TRACKING_URI"]
    assert uri.startswith("http://127.0.0.1:")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # undone after the test, for the tests that follow
    monkeypatch.setattr(mlflow.tracking._tracking_service.utils, "_tracking_uri", uri)  # mlflow's global
    client = mlflow.MlflowClient(uri)
    experiment = client.get_experiment_by_name("team-registry") or client.get_experiment(
        client.create_experiment("team-registry")
    )
    run = client.create_run(experiment.experiment_id)
    code = tmp_path / "shout.py"
    code.write_text(SHOUT)
    example = pd.DataFrame({"text": ["ankle boot"]})
    logged = []

    def log_model():
        logged.append(log_pyfunc(run.info.run_id, uri, code, infer_signature(example, ["ANKLE BOOT"]), example, {}))
        return logged[-1]

    first = register_once(client, "shout", "champion", "ab" * 32, log_model, "a test model")
    assert (first.version, first.action) == ("1", "registered")
    again = register_once(client, "shout", "champion", "ab" * 32, log_model, "a test model")
    assert (again.version, again.action) == ("1", "already current") and len(logged) == 1
    version = client.get_model_version_by_alias("shout", "champion")
    assert version.version == "1" and version.tags["weights_sha256"] == "ab" * 32
    assert client.get_model_version_download_uri("shout", "1").startswith("mlflow-artifacts:")  # proxied to S3
    model = mlflow.pyfunc.load_model("models:/shout@champion")
    assert list(model.predict(pd.DataFrame({"text": ["sandal", "bag"]}))) == ["SANDAL", "BAG"]
    with pytest.raises(MlflowException, match=r"Invalid model version source: 'models:/m-.*model_id request"):
        client.create_model_version("shout", logged[0].model_uri, run_id=logged[0].run_id)


BACKFILL = """mutation($params: LaunchBackfillParams!) { launchPartitionBackfill(backfillParams: $params) {
  __typename ... on LaunchBackfillSuccess { backfillId } ... on PythonError { message } } }"""
BACKFILL_STATUS = """query($id: String!) { partitionBackfillOrError(backfillId: $id) {
  ... on PartitionBackfill { status } } }"""
ADD_PARTITION = """mutation($selector: RepositorySelector!, $name: String!, $key: String!) {
  addDynamicPartition(repositorySelector: $selector, partitionsDefName: $name, partitionKey: $key) {
  __typename ... on PythonError { message } } }"""


def step_failure(instance, run_id: str) -> str:
    """What a run's failed step said (a dg.Failure's description, or the error)."""
    import dagster as dg

    said = []
    for record in instance.get_records_for_run(run_id, of_type=dg.DagsterEventType.STEP_FAILURE).records:
        data = record.event_log_entry.dagster_event.step_failure_data
        said.append(data.user_failure_data.description if data.user_failure_data else data.error.message)
    return "\n".join(said)


def partition_of(run) -> str:
    """The one partition of a backfill run (a backfill's runs name theirs as a range, here of one)."""
    start, end = (run.tags.get(f"dagster/asset_partition_range_{edge}") for edge in ("start", "end"))
    assert start == end, f"run {run.run_id} holds {start}..{end}: one partition a run expected"
    return start


def python_docs_corpus(offline_data: Path, root: Path) -> list[str]:
    """Python's documentation (497 pages, one document each) as zstd JSON-lines chunks, the shape of
    SlimPajama's: a first chunk of every page three times (its run is killed in the middle: seconds of
    tokenizing, even on a machine several times faster), two of every other page each, and one whose
    line 5 is not JSON."""
    import json

    import zstd

    pages = sorted((offline_data / "python-docs").rglob("*.rst.txt"))
    rows = [json.dumps({"text": page.read_text(), "meta": {"page": page.name}}) for page in pages]
    root.mkdir()
    groups = [rows * 3, rows[0::2], rows[1::2]]  # the halves hold every page once: four times the docs in all
    for i, group in enumerate(groups):
        (root / f"part-{i:02d}.jsonl.zst").write_bytes(zstd.compress("\n".join(group).encode()))
    (root / "part-99.jsonl.zst").write_bytes(zstd.compress("\n".join([*rows[:4], "{oops", *rows[4:8]]).encode()))
    return sorted(p.name for p in root.iterdir())


@pytest.mark.timeout(3600)  # each wait is bounded on its own by wait_until
def test_a_backfill_tokenizes_chunks_two_runs_at_a_time_retries_a_killed_run_and_the_gpt_trains_on_all(
    team, offline_data
):
    """A corpus of four chunks backfilled through the webserver (the UI's path): one run per partition,
    at most two at once (the backfill runs' tag limit in the instance; the queue alone would start all
    four), on the S3 store. One run is SIGKILLed in the middle of its chunk: run monitoring fails it,
    the daemon retries it (the backfill's `dagster/max_retries`), and no other partition is built twice.
    The corrupt chunk fails alone, naming its file and line, without a retry. Then gpt_job merges the
    three good partitions and trains on them, streaming from S3."""
    import dagster as dg

    from vlm_assets.defs.platform.run_launcher import run_worker

    source = team.root / "corpus"
    keys = python_docs_corpus(offline_data, source)
    for key in keys:  # the UI's "Add partition"
        added = team.graphql(ADD_PARTITION, selector=REPOSITORY, name="token_chunks", key=key)
        assert added["addDynamicPartition"]["__typename"] == "AddDynamicPartitionSuccess", added
    chunks = {"source_dir": str(source), "tokenizer": str(offline_data / "gpt2-tokenizer"), "max_length": 256}
    launched = team.graphql(
        BACKFILL,
        params={
            "partitionNames": keys,
            "assetSelection": [{"path": ["token_chunks"]}],
            "tags": [{"key": "dagster/max_retries", "value": "2"}],
            "runConfigData": {"ops": {"token_chunks": {"config": chunks}}},
        },
    )["launchPartitionBackfill"]
    assert launched["__typename"] == "LaunchBackfillSuccess", launched
    backfill = launched["backfillId"]
    instance = team.instance()

    def backfill_runs() -> list:
        return instance.get_runs(filters=dg.RunsFilter(tags={"dagster/backfill": backfill}))

    def first_chunk_tokenizing():  # the big chunk's run, inside its step
        for run in backfill_runs():
            if partition_of(run) == keys[0] and run.status == dg.DagsterRunStatus.STARTED:
                logs = instance.get_records_for_run(run.run_id, of_type=dg.DagsterEventType.STEP_START).records
                if logs:
                    return run
        return None

    killed = wait_until(first_chunk_tokenizing, f"the run of {keys[0]} to start its step", every=0.2)
    pid, _ = run_worker(instance, killed.run_id)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        raise AssertionError(f"the run of {keys[0]} ended before it could be killed: give it a larger chunk") from None

    def backfill_done():
        status = team.graphql(BACKFILL_STATUS, id=backfill)["partitionBackfillOrError"]["status"]
        runs = backfill_runs()
        ended = all(r.is_finished for r in runs) and any(r.tags.get("dagster/parent_run_id") for r in runs)
        return status in ("COMPLETED", "COMPLETED_SUCCESS", "COMPLETED_FAILED", "FAILED") and ended and status

    status = wait_until(backfill_done, "the backfill and the retry of its killed run to end", timeout=1800, every=2)
    runs = backfill_runs()
    by_partition: dict[str, list] = {}
    for run in sorted(runs, key=lambda r: instance.get_run_record_by_id(r.run_id).create_timestamp):
        by_partition.setdefault(partition_of(run), []).append(run)
    statuses = {k: [r.status.value for r in rs] for k, rs in by_partition.items()}
    assert (
        statuses
        == {
            keys[0]: ["FAILURE", "SUCCESS"],  # killed, then retried by the daemon
            **{k: ["SUCCESS"] for k in keys[1:-1]},
            keys[-1]: ["FAILURE"],  # bad input: a step failure, not retried
        }
    ), (status, statuses, [team.failure(r.run_id) for r in runs if r.status != dg.DagsterRunStatus.SUCCESS])
    assert by_partition[keys[0]][1].tags["dagster/parent_run_id"] == killed.run_id
    assert f"{source / keys[-1]}:5: not valid JSON" in step_failure(instance, by_partition[keys[-1]][0].run_id)

    # Two at once, never three: the runs' start-to-end windows overlap two deep, never three (the daemon
    # dequeues the backfill's runs together, each far longer than its dequeue interval).
    windows = [(s.start_time, s.end_time) for s in (instance.get_run_stats(r.run_id) for r in runs) if s.start_time]
    edges = sorted([(start, 1) for start, _ in windows] + [(end, -1) for _, end in windows])
    depth = [sum(d for _, d in edges[: i + 1]) for i in range(len(edges))]
    assert max(depth) == 2, windows

    # Every good partition was materialized once and built once (the retry rebuilt only the killed chunk).
    materialized = {}
    for record in instance.fetch_materializations(dg.AssetKey("token_chunks"), limit=100).records:
        materialized.setdefault(record.partition_key, []).append(
            record.asset_materialization.metadata["cache"].value[record.partition_key]
        )
    assert materialized == {k: ["miss"] for k in keys[:-1]}, materialized

    # The GPT reads the merged dataset of every partition: the corrupt chunk's partition is removed first.
    instance.delete_dynamic_partition("token_chunks", keys[-1])
    gpt = team.launch(
        "gpt_job",
        {
            "ops": {
                "token_shards": {"config": {"source": "chunks"}},
                "gpt_checkpoint": {
                    "config": {
                        "seed": 5,
                        # the blocking check (val loss 1 nat below uniform) passes at step 10 by ~0.3 nat
                        "optimizer": {"max_steps": 10, "warmup_steps": 2},
                        "data": {"val_check_interval": 10, "val_batches": 2},
                        "checkpoint": {"every": 10},
                        "parallelism": {"num_nodes": 1},
                        "log_every": 5,
                    }
                },
            }
        },
    )
    assert team.wait_for_end(gpt) == "SUCCESS", team.failure(gpt)
    events = instance.get_records_for_run(gpt, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION).records
    meta = {
        e.event_log_entry.dagster_event.asset_key.to_user_string(): {
            k: getattr(v, "value", v) for k, v in e.event_log_entry.dagster_event.materialization.metadata.items()
        }
        for e in events
    }
    shards, checkpoint = meta["token_shards"], meta["gpt_checkpoint"]
    good = len(keys) - 1
    assert shards["partitions"] == good and shards["uri"].startswith("s3://"), shards
    assert checkpoint["dataset_partitions"] == good, checkpoint
    text_tokens = shards["train_num_tokens"] - shards["train_num_padding"]  # each chunk pads its last block
    assert checkpoint["dataset_train_tokens"] == text_tokens > 1_000_000, (checkpoint, shards)
    assert 0 < shards["train_num_padding"] < good * 256, shards
    assert checkpoint["dataset_train_shards"] == shards["train_num_shards"] >= good
