"""One-time AWS setup for cluster/aws.yaml: what `ray up` would otherwise create too openly.

Ray's AWS bootstrap creates a security group that opens SSH (22) to 0.0.0.0/0, and gives every
node the head's instance profile (full EC2 and S3 access). Run this once per account and region
instead; it creates (or finds and reuses):

- a security group ``elastic-train-nodes`` in the default VPC (or ``--vpc-id``) that allows SSH
  only from ``--ssh-cidr`` and all traffic between the group's own members, and nothing else;
- an IAM role and instance profile ``elastic-train-worker`` for the GPU workers that may read
  and write the run bucket ``--bucket`` only (checkpoints and Parquet data), nothing else.

It prints the two values to put into cluster/aws.yaml (the lines marked CHANGE). Credentials
come from the standard AWS environment, as for `ray up`.

    python cluster/aws_setup.py --region us-west-2 --ssh-cidr 203.0.113.7/32 --bucket my-runs
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import sys

GROUP_NAME = "elastic-train-nodes"
WORKER_PROFILE = "elastic-train-worker"


def security_group(ec2, ssh_cidr: str, vpc_id: str | None = None) -> str:
    """The cluster's security group (created once); returns its ID."""
    network = ipaddress.ip_network(ssh_cidr, strict=False)
    if network.prefixlen == 0:
        raise ValueError(f"--ssh-cidr {ssh_cidr} opens SSH to every address; give your own "
                         "address or network (e.g. 203.0.113.7/32)")
    if vpc_id is None:
        vpcs = ec2.describe_vpcs(Filters=[{"Name": "isDefault", "Values": ["true"]}])["Vpcs"]
        if not vpcs:
            raise ValueError("this region has no default VPC: pass --vpc-id")
        vpc_id = vpcs[0]["VpcId"]
    found = ec2.describe_security_groups(Filters=[
        {"Name": "group-name", "Values": [GROUP_NAME]}, {"Name": "vpc-id", "Values": [vpc_id]},
    ])["SecurityGroups"]
    if found:
        return found[0]["GroupId"]
    group_id = ec2.create_security_group(
        GroupName=GROUP_NAME, VpcId=vpc_id,
        Description="elastic-train: SSH from one network, all traffic between cluster nodes",
    )["GroupId"]
    ec2.authorize_security_group_ingress(GroupId=group_id, IpPermissions=[
        {"IpProtocol": "tcp", "FromPort": 22, "ToPort": 22,
         "IpRanges": [{"CidrIp": str(network), "Description": "SSH for ray up"}]},
        {"IpProtocol": "-1", "UserIdGroupPairs": [{"GroupId": group_id}]},
    ])
    return group_id


def bucket_policy(bucket: str) -> dict:
    """Read, write and list one bucket: what workers need for checkpoints and Parquet."""
    return {
        "Version": "2012-10-17",
        "Statement": [
            {"Effect": "Allow", "Action": ["s3:ListBucket", "s3:GetBucketLocation"],
             "Resource": f"arn:aws:s3:::{bucket}"},
            {"Effect": "Allow",
             "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject",
                        "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts"],
             "Resource": f"arn:aws:s3:::{bucket}/*"},
        ],
    }


def worker_profile(iam, bucket: str) -> str:
    """The workers' instance profile (created once), scoped to ``bucket``; returns its name."""
    trust = {"Version": "2012-10-17", "Statement": [{
        "Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"},
        "Action": "sts:AssumeRole"}]}
    try:
        iam.get_role(RoleName=WORKER_PROFILE)
    except iam.exceptions.NoSuchEntityException:
        iam.create_role(RoleName=WORKER_PROFILE, AssumeRolePolicyDocument=json.dumps(trust))
    iam.put_role_policy(RoleName=WORKER_PROFILE, PolicyName="run-bucket",
                        PolicyDocument=json.dumps(bucket_policy(bucket)))
    try:
        profile = iam.get_instance_profile(InstanceProfileName=WORKER_PROFILE)["InstanceProfile"]
    except iam.exceptions.NoSuchEntityException:
        profile = iam.create_instance_profile(
            InstanceProfileName=WORKER_PROFILE)["InstanceProfile"]
    if not any(role["RoleName"] == WORKER_PROFILE for role in profile.get("Roles", [])):
        iam.add_role_to_instance_profile(InstanceProfileName=WORKER_PROFILE,
                                         RoleName=WORKER_PROFILE)
    return WORKER_PROFILE


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--region", required=True)
    parser.add_argument("--ssh-cidr", required=True,
                        help="where you run `ray up` from, e.g. 203.0.113.7/32")
    parser.add_argument("--bucket", required=True, help="the bucket of --storage-path")
    parser.add_argument("--vpc-id", default=None, help="default: the region's default VPC")
    args = parser.parse_args(argv)
    import boto3

    try:
        group_id = security_group(boto3.client("ec2", region_name=args.region), args.ssh_cidr,
                                  args.vpc_id)
        profile = worker_profile(boto3.client("iam"), args.bucket)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print("Put these into cluster/aws.yaml (the lines marked CHANGE):")
    print(f"  SecurityGroupIds: [{group_id}]        # both node types")
    print(f"  IamInstanceProfile: {{Name: {profile}}}  # worker.gpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
