"""The end-to-end tests' cluster: the dev cluster with its real node and the project's image.

``dev_cluster`` here (overriding the session one, which has fake nodes only) builds the CPU
image from images/cpu/Dockerfile with buildah (cached under ``~/.cache/ddm/images``: about 8
minutes cold, seconds when nothing changed), starts a dev cluster whose real node runs the
kubelet, kube-proxy and containerd, imports the image into that containerd and stops it all
when the package's tests are done, so the integration tests' cluster never runs beside it.
Without root, buildah or the kube binaries it skips, except under CI, where it fails.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from ddm_devcluster import BuildError, ClusterInfo, down, ensure_binaries, up
from ddm_devcluster import images as dev_images
from ddm_devcluster.apt import AptError
from ddm_devcluster.build import log_stderr
from ddm_devcluster.cluster import node_layout
from ddm_devcluster.namespaces import NamespaceError

def _unavailable(message: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="package")
def dev_cluster(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config
                ) -> Iterator[ClusterInfo]:
    """A dev cluster with its real node, the chart's images (operator, CPU) imported; admin
    credentials."""
    if os.geteuid() != 0:
        _unavailable("the real node needs root (namespaces, cgroups, containerd)")
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():  # show build and start-up progress live
        try:
            binaries = ensure_binaries(allow_build=os.environ.get("DDM_DEV_CLUSTER_BUILD") != "0")
            built = {image.name: dev_images.build_project_image(image, log=log_stderr)
                     for image in dev_images.CHART_IMAGES}
            state_dir = tmp_path_factory.mktemp("dev-cluster")
            info = up(state_dir, binaries=binaries, real_node=True)
        except (BuildError, AptError, NamespaceError, dev_images.ImageError) as error:
            _unavailable(f"no real node: {error}")
        try:
            dev_images.import_into_containerd(list(built), node_layout(state_dir).ctr(),
                                              ids=built, log=log_stderr)
        except BaseException:
            down(state_dir)
            raise
    try:
        yield info
    finally:
        down(state_dir)


@pytest.fixture(scope="package")
def kube_client(dev_cluster: ClusterInfo) -> Iterator[Any]:
    """A ``kubernetes.client.ApiClient`` logged in as the real-node cluster's admin."""
    from kubernetes import config

    client = config.new_client_from_config(config_file=str(dev_cluster.kubeconfig))
    try:
        yield client
    finally:
        client.close()
