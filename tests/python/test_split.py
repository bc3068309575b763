"""gradaccum.split: one batch into micro-batches along dim 0."""
import collections

import pytest
import torch

import gradaccum

Batch = collections.namedtuple("Batch", ["x", "y"])

SHAPES = [(10, 3), (12, 4), (9, 4), (5, 5), (7, 1), (1, 1), (100, 7)]


def expected_sizes(rows, steps):
    return [rows // steps + (1 if k < rows % steps else 0) for k in range(steps)]


@pytest.mark.parametrize("rows,steps", SHAPES)
def test_tensor_sizes_and_contents(rows, steps):
    x = torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2)
    parts = gradaccum.split(x, steps)
    assert isinstance(parts, list)
    assert len(parts) == steps
    sizes = [p.shape[0] for p in parts]
    assert sizes == expected_sizes(rows, steps)
    assert max(sizes) - min(sizes) <= 1
    # The first rows % steps parts get the extra row, as torch.tensor_split.
    reference = torch.tensor_split(x, steps)
    for part, ref in zip(parts, reference):
        assert part.shape[1:] == x.shape[1:]
        assert torch.equal(part, ref)
    assert torch.equal(torch.cat(parts), x)


def test_documented_example():
    x, y = torch.randn(10, 3), torch.randn(10)
    assert [tuple(m[0].shape) for m in gradaccum.split((x, y), 3)] == [(4, 3), (3, 3), (3, 3)]


def test_parts_are_views():
    x = torch.zeros(9, 4)
    parts = gradaccum.split(x, 3)
    for part in parts:
        assert part.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    parts[1].fill_(7.0)
    assert torch.equal(x[3:6], torch.full((3, 4), 7.0))
    assert torch.equal(x[:3], torch.zeros(3, 4))
    assert torch.equal(x[6:], torch.zeros(3, 4))


def test_split_along_dim0_only_and_noncontiguous():
    base = torch.arange(4 * 7 * 3, dtype=torch.float64).reshape(4, 7, 3)
    x = base.transpose(0, 1)  # (7, 4, 3), not contiguous
    assert not x.is_contiguous()
    parts = gradaccum.split(x, 3)
    assert [p.shape for p in parts] == [torch.Size([3, 4, 3]), torch.Size([2, 4, 3]),
                                        torch.Size([2, 4, 3])]
    assert torch.equal(torch.cat(parts), x)


def test_gradient_flows_through_parts():
    x = torch.randn(7, 2, requires_grad=True)
    parts = gradaccum.split(x, 3)
    sum(((k + 1) * p).sum() for k, p in enumerate(parts)).backward()
    expected = torch.tensor([1.0] * 3 + [2.0] * 2 + [3.0] * 2)[:, None].expand(7, 2)
    assert torch.equal(x.grad, expected)


@pytest.mark.parametrize("rows,steps", [(10, 3), (8, 8), (5, 2)])
def test_tuple_and_list_stay_aligned(rows, steps):
    x = torch.arange(rows)
    y = torch.arange(rows) * 10
    z = torch.randn(rows, 2, 2)
    for container in (tuple, list):
        parts = gradaccum.split(container([x, y, z]), steps)
        assert len(parts) == steps
        start = 0
        for part, size in zip(parts, expected_sizes(rows, steps)):
            assert type(part) is container
            assert len(part) == 3
            assert torch.equal(part[0], x[start:start + size])
            assert torch.equal(part[1], part[0] * 10)
            assert torch.equal(part[2], z[start:start + size])
            start += size


def test_dict():
    batch = {"input": torch.arange(10), "label": torch.arange(10) + 100}
    parts = gradaccum.split(batch, 4)
    assert [list(p) for p in parts] == [["input", "label"]] * 4
    assert [p["input"].tolist() for p in parts] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    for p in parts:
        assert torch.equal(p["label"], p["input"] + 100)


def test_mappings_keep_their_type():
    # Hugging Face's tokenizers and collators return BatchEncoding (a
    # UserDict, not a dict); it stays one, split like a dict, nested too.
    transformers = pytest.importorskip("transformers")
    enc = transformers.BatchEncoding({"input_ids": torch.arange(8).view(4, 2), "attention_mask": torch.ones(4, 2)})
    parts = gradaccum.split(enc, 2)
    assert [type(p) for p in parts] == [transformers.BatchEncoding] * 2
    assert [p["input_ids"].tolist() for p in parts] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert parts[1].input_ids.data_ptr() == enc["input_ids"][2:].data_ptr()  # views, attribute access kept
    nested = gradaccum.split({"enc": enc, "y": torch.arange(4)}, 2)
    assert [p["enc"]["input_ids"].shape[0] for p in nested] == [2, 2]
    assert [p["y"].tolist() for p in nested] == [[0, 1], [2, 3]]
    # Mappings built otherwise: a defaultdict keeps its factory, an OrderedDict its order.
    dd = collections.defaultdict(list, {"x": torch.arange(3), "names": ["a", "b", "c"]})
    parts = gradaccum.split(dd, 3)
    assert [type(p) for p in parts] == [collections.defaultdict] * 3
    assert parts[0].default_factory is list and parts[2]["names"] == ["c"]
    od = collections.OrderedDict([("b", torch.arange(2)), ("a", torch.arange(2) + 5)])
    assert [list(p) for p in gradaccum.split(od, 2)] == [["b", "a"], ["b", "a"]]
    assert type(gradaccum.split(od, 2)[0]) is collections.OrderedDict


def test_namedtuple():
    batch = Batch(torch.arange(6), torch.arange(6) * 2)
    parts = gradaccum.split(batch, 4)
    assert [len(p.x) for p in parts] == [2, 2, 1, 1]
    for p in parts:
        assert type(p) is Batch
        assert torch.equal(p.y, p.x * 2)


def test_nested():
    rows = 11
    batch = {
        "a": (torch.arange(rows), [torch.arange(rows) + 1, {"deep": torch.arange(rows) + 2}]),
        "b": Batch(torch.arange(rows) + 3, torch.zeros(rows, 5)),
    }
    parts = gradaccum.split(batch, 3)
    assert len(parts) == 3
    start = 0
    for part, size in zip(parts, expected_sizes(rows, 3)):
        rows_ = torch.arange(start, start + size)
        assert set(part) == {"a", "b"}
        assert isinstance(part["a"], tuple) and isinstance(part["a"][1], list)
        assert isinstance(part["a"][1][1], dict)
        assert type(part["b"]) is Batch
        assert torch.equal(part["a"][0], rows_)
        assert torch.equal(part["a"][1][0], rows_ + 1)
        assert torch.equal(part["a"][1][1]["deep"], rows_ + 2)
        assert torch.equal(part["b"].x, rows_ + 3)
        assert part["b"].y.shape == (size, 5)
        start += size
    assert start == rows


def test_mixed_dtypes_and_devices_kept():
    batch = (torch.arange(6, dtype=torch.int64), torch.ones(6, dtype=torch.bool),
             torch.randn(6, dtype=torch.float16))
    for part in gradaccum.split(batch, 2):
        assert [t.dtype for t in part] == [torch.int64, torch.bool, torch.float16]
        assert all(t.device == torch.device("cpu") for t in part)


def test_steps_one_returns_whole_batch_view():
    x = torch.randn(5, 3)
    (part,) = gradaccum.split(x, 1)
    assert torch.equal(part, x)
    assert part.data_ptr() == x.data_ptr()


def test_non_tensor_fields_pass_through():
    """A Hugging Face-style batch: lists of per-sample values are split
    alongside the tensors, everything else without a tensor is repeated."""
    rows = 5
    batch = {
        "input_ids": torch.arange(rows * 2).reshape(rows, 2),
        "text": [f"sample {i}" for i in range(rows)],
        "ids": list(range(100, 100 + rows)),
        "task": "lm",
        "scale": 0.5,
        "image_size": (32, 32),
        "extra": None,
        "pair": Batch(torch.arange(rows), ["x"] * rows),
    }
    parts = gradaccum.split(batch, 2)
    assert [p["text"] for p in parts] == [[f"sample {i}" for i in range(3)], ["sample 3", "sample 4"]]
    assert [p["ids"] for p in parts] == [[100, 101, 102], [103, 104]]
    start = 0
    for part, size in zip(parts, expected_sizes(rows, 2)):
        assert torch.equal(part["input_ids"], batch["input_ids"][start:start + size])
        assert (part["task"], part["scale"], part["image_size"], part["extra"]) == ("lm", 0.5, (32, 32), None)
        assert type(part["pair"]) is Batch and part["pair"].y == ["x"] * size
        assert torch.equal(part["pair"].x, torch.arange(start, start + size))
        start += size
    # A tensor next to plain values in a tuple: the values are repeated.
    assert [p[1] for p in gradaccum.split((torch.randn(4), 3), 2)] == [3, 3]


def test_lists_alone_are_split():
    parts = gradaccum.split({"text": ["a", "b", "c"], "lang": "en"}, 2)
    assert parts == [{"text": ["a", "b"], "lang": "en"}, {"text": ["c"], "lang": "en"}]
    with pytest.raises(ValueError, match="cannot split 3 rows into 4 micro-batches"):
        gradaccum.split(["a", "b", "c"], 4)
    # An empty list has 0 values, not the batch's rows: refused, never repeated (review).
    with pytest.raises(ValueError, match=r"^gradaccum: split\(\): batch\['ids'\] is a list of 0 values, but the "
                                         r"batch has 10 rows"):
        gradaccum.split({"x": torch.zeros(10, 2), "ids": []}, 2)
    with pytest.raises(ValueError, match="cannot split 0 rows into 2 micro-batches"):
        gradaccum.split({"ids": []}, 2)


def test_numpy_scalars_are_repeated_and_run_takes_numpy_fields_whole():
    import numpy as np

    from gradaccum._run import _rows

    parts = gradaccum.split({"x": torch.arange(4), "step": np.int64(3)}, 2)
    assert [int(p["step"]) for p in parts] == [3, 3]
    # run() only asks how many rows a batch has; one it cannot split runs whole.
    assert _rows({"x": torch.zeros(4, 2), "np": np.zeros(4)}) is None
    assert _rows({"x": torch.zeros(4, 2), "text": ["a", "b", "c", "d"]}) == 4
