"""cluster/aws.yaml and cluster/local.yaml, checked at each layer that runs here: Ray's own schema
and config preparation (what `ray up` does first), botocore's EC2 model for every node_config,
and the AWS bootstrap plus node provider that `ray up` runs, against moto's in-process AWS mock.

Nothing here opens a network connection: moto intercepts boto3 in this process, and the mock
instances are never contacted (no `ray up` against them; that runs on loopback in test_cluster_up).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import botocore.session
import jsonschema
import pytest
import ray.autoscaler
import yaml
from botocore.validate import ParamValidator
from ray.autoscaler._private.util import prepare_config, validate_config

from app.cluster import FAST_RECOVERY_SYSTEM_CONFIG

ROOT = Path(__file__).resolve().parent.parent
YAMLS = {"aws": ROOT / "cluster" / "aws.yaml", "local": ROOT / "cluster" / "local.yaml"}
RAY_SCHEMA = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())


def _load(name: str) -> dict:
    return yaml.safe_load(YAMLS[name].read_text())


def _validate(config: dict) -> dict:
    """Ray's schema on the file as written, then the preparation and checks of `ray up`."""
    jsonschema.validate(config, RAY_SCHEMA)
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def _run_instances_errors(node_config: dict) -> str:
    """botocore's RunInstances input model: Ray's schema takes any object as a node_config."""
    shape = botocore.session.get_session().get_service_model("ec2") \
        .operation_model("RunInstances").input_shape
    # ray up adds these (counts, and the AMI/key/subnets/security group the bootstrap resolves).
    params = {"MinCount": 1, "MaxCount": 1, "ImageId": "ami-12345678", **node_config}
    report = ParamValidator().validate(params, shape)
    return report.generate_report() if report.has_errors() else ""


@pytest.mark.parametrize("name", sorted(YAMLS))
def test_cluster_yaml_passes_rays_schema_and_preparation(name):
    prepared = _validate(_load(name))
    assert prepared["head_node_type"] in prepared["available_node_types"]
    for node_type in prepared["available_node_types"].values():
        assert "resources" in node_type


def test_aws_node_configs_match_the_ec2_api():
    config = _load("aws")
    for name, node_type in config["available_node_types"].items():
        assert _run_instances_errors(node_type["node_config"]) == "", name


def test_aws_yaml_says_what_the_product_needs():
    config = _load("aws")
    head = config["available_node_types"][config["head_node_type"]]
    workers = [t for n, t in config["available_node_types"].items() if n != config["head_node_type"]]
    # CPU head on on-demand capacity; GPU workers on spot, scaled between min and max.
    assert "InstanceMarketOptions" not in head["node_config"]
    assert head["resources"].get("GPU", 0) == 0
    assert workers and all(
        t["node_config"]["InstanceMarketOptions"]["MarketType"] == "spot"
        and t["resources"]["GPU"] == 1 and t["min_workers"] < t["max_workers"]
        for t in workers
    )
    assert config["idle_timeout_minutes"] > 0
    # Start commands apply the embedded cluster's fast-recovery settings, dashboard on loopback.
    start = " ".join(config["head_start_ray_commands"])
    system_config = json.loads(start.split("--system-config='", 1)[1].split("'", 1)[0])
    assert system_config == FAST_RECOVERY_SYSTEM_CONFIG
    assert "--dashboard-host=127.0.0.1" in start
    # The project (and through it ray[default], Train, Tune, torch) is installed on every node.
    assert any("pip install" in c and "ray-elastic-train" in c for c in config["setup_commands"])
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"ray[default,train,tune]' in pyproject
    # The secure shape: every node in the security group aws_setup.py makes (Ray's own opens SSH
    # to 0.0.0.0/0), IMDSv2 only, workers with the bucket-scoped profile (not the head's).
    for node_type in config["available_node_types"].values():
        node_config = node_type["node_config"]
        assert node_config["SecurityGroupIds"] and node_config["MetadataOptions"]["HttpTokens"] \
            == "required"
    assert all(t["node_config"]["IamInstanceProfile"]["Name"] == "elastic-train-worker"
               for t in workers)
    assert "IamInstanceProfile" not in head["node_config"], "the head gets Ray's (it launches)"
    assert "security_group" not in config["provider"]


@pytest.mark.parametrize("name", sorted(YAMLS))
def test_every_node_requires_the_clusters_token_and_gets_it(name):
    config = _load(name)
    for command in config["head_start_ray_commands"][1:] + config["worker_start_ray_commands"][1:]:
        assert "export RAY_AUTH_MODE=token;" in command and "ray start" in command
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"


@pytest.mark.parametrize("name", sorted(YAMLS))
def test_file_mounts_leave_secrets_and_environments_behind(name):
    config = _load(name)
    assert config["file_mounts"]["~/ray-elastic-train"] == "."
    assert config["rsync_filter"] == [".gitignore"]
    for private in (".venv", ".env", "*.pem", ".aws", ".git"):
        assert private in config["rsync_exclude"]
    assert "run it from the repository root" in YAMLS[name].read_text() \
        or "is where `ray up` runs: the repository root" in YAMLS[name].read_text()


@pytest.mark.parametrize("name", sorted(YAMLS))
def test_every_node_installs_the_pinned_versions(name):
    config = _load(name)
    setup = " ".join(config["setup_commands"])
    assert "-c ~/ray-elastic-train/cluster/constraints.txt" in setup
    pins = dict(line.split("==", 1) for line in
                (ROOT / "cluster" / "constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    from importlib.metadata import version

    for package in ("torch", "ray", "pyarrow", "torchvision", "numpy"):
        assert pins[package] == version(package), package
    major, minor = (int(part) for part in pins["torch"].split(".")[:2])
    assert (major, minor) >= (2, 6)
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"torch>=2.6"' in pyproject and '"pyarrow>=14.0.1"' in pyproject


def test_readme_and_ci_install_the_pinned_versions_and_run_the_same_tests():
    # A fresh install that dropped the constraints would resolve the newest releases, and the test
    # above would fail only on the next upstream release; so the flag is checked where it is used.
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    readme_installs = [line for line in readme.splitlines() if "pip install" in line
                       and "-e '.[test]'" in line and line.startswith("python3 -m venv")]
    ci_installs = [line for line in ci.splitlines() if "pip_step install" in line and "-e" in line
                   and "--no-deps" not in line]
    assert len(readme_installs) == 2 and len(ci_installs) == 1
    for line in readme_installs + ci_installs:
        assert "-c cluster/constraints.txt" in line, line
    readme_tests = readme_installs[1].split(".venv/bin/python -m pytest", 1)[1].strip()
    ci_tests = [line for line in ci.splitlines() if line.startswith("python -m pytest")]
    assert ci_tests == [f"python -m pytest {readme_tests} -p no:cacheprovider"]


def test_no_credentials_in_cluster_files():
    for path in YAMLS.values():
        text = path.read_text().lower()
        for secret in ("aws_access_key_id", "aws_secret_access_key", "akia", "password"):
            assert secret not in text, f"{path.name} mentions {secret}"


@pytest.mark.parametrize(
    ("break_it", "message"),
    [
        (lambda c: c.update(bogus_key=1), "'bogus_key' was unexpected"),
        (lambda c: c.update(max_workers="eight"), "'eight' is not of type 'integer'"),
        (lambda c: c.update(head_node_type="no.such.type"), "must be one of"),
        (lambda c: c["available_node_types"]["worker.gpu"].pop("resources"),
         "'resources' is a required property"),
    ],
    ids=["unknown key", "wrong type", "head type not among node types", "no resources"],
)
def test_broken_aws_yaml_fails_with_a_clear_message(break_it, message):
    config = _load("aws")
    break_it(config)
    with pytest.raises((jsonschema.ValidationError, ValueError)) as caught:
        _validate(config)
    assert message in str(caught.value).splitlines()[0]


def test_misspelled_node_config_key_is_caught_by_the_ec2_model():
    node_config = dict(_load("aws")["available_node_types"]["worker.gpu"]["node_config"])
    node_config["InstanceTyp"] = node_config.pop("InstanceType")
    # Ray's schema accepts it...
    config = _load("aws")
    config["available_node_types"]["worker.gpu"]["node_config"] = node_config
    _validate(config)
    # ...EC2's model does not.
    assert 'Unknown parameter in input: "InstanceTyp"' in _run_instances_errors(node_config)


@pytest.fixture
def mock_aws_env(tmp_path, monkeypatch):
    """moto's in-process AWS with fake credentials, no user config, and a throwaway HOME (the
    bootstrap writes the new key pair's private key to ~/.ssh)."""
    from moto import mock_aws

    for key in ("AWS_ENDPOINT_URL", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-west-2")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    # The role the bootstrap creates attaches AWS-managed policies, which moto loads on request.
    monkeypatch.setenv("MOTO_IAM_LOAD_MANAGED_POLICIES", "true")
    # After creating the IAM profile and role the bootstrap sleeps 2 x 15 s for AWS's eventual
    # consistency, which a mock does not have.
    import ray.autoscaler._private.aws.config as aws_config

    monkeypatch.setattr(aws_config.time, "sleep", lambda seconds: None)
    # Ray caches AWS clients and resources per region; a previous mock's must not be reused.
    from ray.autoscaler._private.aws import utils as aws_utils

    for cached in ("resource_cache", "client_cache"):
        function = getattr(aws_utils, cached, None)
        if hasattr(function, "cache_clear"):
            function.cache_clear()
    with mock_aws():
        yield tmp_path


def _aws_setup():
    import importlib.util

    spec = importlib.util.spec_from_file_location("aws_setup", ROOT / "cluster" / "aws_setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_aws_setup_refuses_ssh_from_everywhere(mock_aws_env, capsys):
    assert _aws_setup().main(["--region", "us-west-2", "--ssh-cidr", "0.0.0.0/0",
                              "--bucket", "runs"]) == 2
    assert "opens SSH to every address" in capsys.readouterr().err


def test_aws_bootstrap_and_node_provider_create_the_cluster(mock_aws_env, capsys):
    import boto3
    from ray.autoscaler._private.aws.config import bootstrap_aws
    from ray.autoscaler._private.aws.node_provider import AWSNodeProvider
    from ray.autoscaler.tags import (
        TAG_RAY_CLUSTER_NAME,
        TAG_RAY_NODE_KIND,
        TAG_RAY_NODE_NAME,
        TAG_RAY_USER_NODE_TYPE,
    )

    # The documented one-time setup, then the YAML with the group it printed.
    assert _aws_setup().main(["--region", "us-west-2", "--ssh-cidr", "203.0.113.7/32",
                              "--bucket", "my-runs"]) == 0
    printed = capsys.readouterr().out
    group_id = printed.split("SecurityGroupIds: [")[1].split("]")[0]
    raw = _load("aws")
    for node_type in raw["available_node_types"].values():
        node_type["node_config"]["SecurityGroupIds"] = [group_id]
    config = bootstrap_aws(_validate(raw))
    region = config["provider"]["region"]
    iam = boto3.client("iam")
    ec2 = boto3.client("ec2", region_name=region)

    # IAM: the head's instance profile (Ray's, it launches workers) may use EC2 and S3; the
    # workers' reaches the run bucket only.
    profile = iam.get_instance_profile(InstanceProfileName="ray-autoscaler-v1")["InstanceProfile"]
    (role,) = profile["Roles"]
    policies = {p["PolicyName"] for p in
                iam.list_attached_role_policies(RoleName=role["RoleName"])["AttachedPolicies"]}
    assert {"AmazonEC2FullAccess", "AmazonS3FullAccess"} <= policies
    worker_profile = iam.get_instance_profile(
        InstanceProfileName="elastic-train-worker")["InstanceProfile"]
    (worker_role,) = worker_profile["Roles"]
    assert iam.list_attached_role_policies(
        RoleName=worker_role["RoleName"])["AttachedPolicies"] == []
    document = iam.get_role_policy(RoleName=worker_role["RoleName"],
                                   PolicyName="run-bucket")["PolicyDocument"]
    resources = {r for statement in document["Statement"] for r in
                 ([statement["Resource"]] if isinstance(statement["Resource"], str)
                  else statement["Resource"])}
    assert resources == {"arn:aws:s3:::my-runs", "arn:aws:s3:::my-runs/*"}
    # Key pair: created, its private key saved for `ray up`'s SSH.
    key_name = config["auth"]["ssh_private_key"]
    assert Path(key_name).is_file() and Path(key_name).is_relative_to(mock_aws_env)
    (key_pair,) = ec2.describe_key_pairs()["KeyPairs"]
    # Security group: the one set up, untouched by Ray: SSH from the given network only, and
    # traffic between the cluster's nodes. Ray created no group of its own.
    head_config = config["available_node_types"]["head.cpu"]["node_config"]
    assert head_config["SecurityGroupIds"] == [group_id]
    (group,) = ec2.describe_security_groups(GroupIds=[group_id])["SecurityGroups"]
    opened = []
    for rule in group["IpPermissions"]:
        if rule.get("UserIdGroupPairs"):
            assert [pair["GroupId"] for pair in rule["UserIdGroupPairs"]] == [group["GroupId"]]
        else:
            opened.append((rule.get("FromPort"), rule.get("ToPort"),
                           [r["CidrIp"] for r in rule.get("IpRanges", [])]))
    assert opened == [(22, 22, ["203.0.113.7/32"])]
    names = {g["GroupName"] for g in ec2.describe_security_groups()["SecurityGroups"]}
    assert not any(name.startswith("ray-autoscaler") for name in names), names
    assert head_config["SubnetIds"] and head_config["KeyName"] == key_pair["KeyName"]

    provider = AWSNodeProvider(config["provider"], config["cluster_name"])
    for kind, node_type, overrides in (("head", "head.cpu", config["head_node"]),
                                       ("worker", "worker.gpu", {})):
        node_config = {**config["available_node_types"][node_type]["node_config"], **overrides}
        provider.create_node(node_config, {
            TAG_RAY_NODE_KIND: kind, TAG_RAY_USER_NODE_TYPE: node_type,
            TAG_RAY_NODE_NAME: f"ray-{config['cluster_name']}-{kind}",
        }, 1)

    instances = {
        tags[TAG_RAY_USER_NODE_TYPE]: instance
        for reservation in ec2.describe_instances()["Reservations"]
        for instance in reservation["Instances"]
        for tags in [{t["Key"]: t["Value"] for t in instance["Tags"]}]
    }
    head, worker = instances["head.cpu"], instances["worker.gpu"]
    assert (head["InstanceType"], worker["InstanceType"]) == ("m5.2xlarge", "g5.xlarge")
    assert "InstanceLifecycle" not in head, "the head runs on on-demand capacity"
    assert worker["InstanceLifecycle"] == "spot"
    for instance in (head, worker):
        tags = {t["Key"]: t["Value"] for t in instance["Tags"]}
        assert tags[TAG_RAY_CLUSTER_NAME] == "elastic-train"
        assert instance["MetadataOptions"]["HttpTokens"] == "required"
        assert instance["KeyName"] == key_pair["KeyName"]
        assert [g["GroupId"] for g in instance["SecurityGroups"]] == [group["GroupId"]]
    assert head["IamInstanceProfile"]["Arn"] == profile["Arn"]
    assert worker["IamInstanceProfile"]["Arn"] == worker_profile["Arn"]
    assert sorted(provider.non_terminated_nodes({TAG_RAY_NODE_KIND: "worker"})) == \
        [worker["InstanceId"]]

    provider.terminate_nodes([head["InstanceId"], worker["InstanceId"]])
    assert provider.non_terminated_nodes({}) == []
    assert os.environ["HOME"] == str(mock_aws_env)
