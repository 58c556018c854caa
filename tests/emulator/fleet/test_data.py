"""Each device's examples: deterministic, non-IID, drawn from the training split only."""

from __future__ import annotations

import numpy as np
import pytest

from emulator.fleet import FleetConfig, device_examples, fleet_dataset, generate_population

#: The module's shared fixture is built once per run: its tests go to one pytest-xdist worker.
pytestmark = pytest.mark.xdist_group("fleet_data")


@pytest.fixture(scope="module")
def fleet():
    config = FleetConfig.default().replace(devices=2000, seed=1)
    return config, generate_population(config)


def test_a_device_gets_the_same_examples_every_time_and_another_device_others(fleet):
    config, devices = fleet
    x1, y1 = device_examples(config, devices[7])
    x2, y2 = device_examples(config, devices[7])
    assert np.array_equal(x1, x2) and np.array_equal(y1, y2)
    x3, _ = device_examples(config, devices[8])
    assert x1.shape != x3.shape or not np.array_equal(x1, x3)
    xs, _ = device_examples(config.replace(seed=2), generate_population(config.replace(seed=2, devices=8))[7])
    assert xs.shape != x1.shape or not np.array_equal(xs, x1)


def test_examples_come_from_the_training_split_and_never_from_the_test_split(fleet):
    config, devices = fleet
    data = fleet_dataset(config)
    train = {row.tobytes() for row in data.x_train}
    test_only = {row.tobytes() for row in data.x_test} - train
    for spec in devices[:50]:
        x, y = device_examples(config, spec)
        assert x.dtype == np.float32 and y.dtype == np.int64 and x.shape == (len(y), data.num_features)
        rows = {row.tobytes() for row in x}
        assert rows <= train and not rows & test_only


def test_sizes_scatter_log_normally_within_their_bounds(fleet):
    config, devices = fleet
    sizes = np.array([len(device_examples(config, spec)[1]) for spec in devices[:600]])
    assert sizes.min() >= config.data.examples_min and sizes.max() <= config.data.examples_max
    assert abs(np.median(sizes) - config.data.examples_median) <= 5
    assert sizes.std() > 10  # devices hold very different amounts of data


def test_label_mixes_are_skewed_unlike_an_iid_sample(fleet):
    config, devices = fleet
    data = fleet_dataset(config)

    def dominant_share(y):
        return np.bincount(y, minlength=data.num_classes).max() / len(y)

    skewed = np.mean([dominant_share(device_examples(config, spec)[1]) for spec in devices[:300]])
    rng = np.random.default_rng(0)
    iid = np.mean([dominant_share(rng.choice(data.y_train, size=40)) for _ in range(300)])
    assert skewed > 0.45 and iid < 0.3
    mixed = config.model_copy(update={"data": config.data.model_copy(update={"label_alpha": 1000.0})})
    assert np.mean([dominant_share(device_examples(mixed, spec)[1]) for spec in devices[:300]]) < 0.3


def test_a_central_test_set_has_no_test_clients_to_take_percentiles_over(tmp_path):
    """An npz's x_test (or a DatasetDict's test split) beside a partitioner's clients is one central
    test set: its one accuracy was reported as p10, p50 and p90 over 'each client's own test
    examples'. Clients with test examples of their own are still the test clients."""
    from emulator.fleet.data import ClientData
    from emulator.fleet.federated_data import load_data

    rng = np.random.default_rng(0)
    x, y = rng.random((60, 4)), np.arange(60) % 3
    np.savez(tmp_path / "keras.npz", x_train=x, y_train=y, x_test=x[:9], y_test=y[:9])
    central = load_data(f"npz:{tmp_path / 'keras.npz'},partition=iid,clients=5")
    assert central.test_split == "central" and central.test_client_ids == ("central",)
    assert ClientData(central, devices=10, seed=0).test_clients() == {}
    assert len(ClientData(central, devices=10, seed=0).central_test()["y"]) == 9  # still the model's accuracy
    np.savez(tmp_path / "plain.npz", x=x, y=y)
    own = load_data(f"npz:{tmp_path / 'plain.npz'},partition=iid,clients=5")
    assert own.test_split == "examples" and sorted(ClientData(own, devices=10, seed=0).test_clients()) == list(
        own.test_client_ids
    )
