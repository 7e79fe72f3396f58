"""data=coco and data=yolo against hostile annotation files (builders in tests/hostile_inputs.py):
each is refused or bounded, one `error:` line where the file cannot be used, counted in
data_report.json where one image or box is at fault, and never a traceback, a hang or gigabytes:

- a COCO file is read element by element (kiln.data.json_stream): memory holds what is kept,
  not the parsed document (a 300 MB file took 4.7 GB); past data.max_json_bytes it is refused
  unparsed; nested 100,000 deep it is one line (was `RecursionError @ step 0`);
- one image with 200,000 boxes keeps data.max_boxes_per_image of them (a million hung 16 min);
- a file_name with `../`, an absolute one or a link out of the images folder is refused and
  counted, never read (four outside images were trained on);
- a 100 MB YOLO label file is refused from its size, a label file linked out of its folder is
  not read, and a data.yaml of aliases (billion laughs) is one line (each passed 6 GB)."""

from __future__ import annotations

import json
import os
import time
import tracemalloc

import pytest

from kiln.data import build_data
from kiln.data.coco import read_coco_file
from kiln.data.detection_files import DetectionDataError

from .conftest import compose_config, train_main_here
from .hostile_inputs import deep_json, encoded, photo, write_coco_like, yaml_bomb

CATEGORIES = [{"id": 1, "name": "cat"}, {"id": 2, "name": "dog"}]


def image_folder(root, count: int = 6):
    root.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        (root / f"img_{i}.png").write_bytes(encoded(photo((40, 30), seed=i), "PNG"))
    return root


def coco_file(path, images, annotations, categories=CATEGORIES):
    path.write_text(
        json.dumps({"images": images, "annotations": annotations, "categories": categories})
    )
    return path


def box(ann_id: int, image_id: int, category: int = 1, bbox=(2, 2, 10, 8)) -> dict:
    return {"id": ann_id, "image_id": image_id, "category_id": category, "bbox": list(bbox)}


def coco_data(tmp_path, json_path, images_root, *extra):
    cfg = compose_config(
        "data=coco",
        "model=detector",
        f"data.train_json={json_path}",
        f"data.train_images={images_root}",
        f"data.cache_dir={tmp_path / 'c'}",
        *extra,
    )
    return build_data(cfg.data)


def six_images(tmp_path):
    """A folder of six good images and a COCO file with one box on each."""
    images = image_folder(tmp_path / "images")
    entries = [{"id": i + 1, "file_name": f"img_{i}.png"} for i in range(6)]
    return images, entries, [box(i + 1, i + 1, 1 + i % 2) for i in range(6)]


def test_a_coco_file_is_parsed_with_bounded_memory(tmp_path):
    """A 10 MB file shaped like COCO 2017 (polygons are most of it): json.load holds ~10x the
    file as Python objects; read element by element, the peak is the read buffer (1 Mi
    characters, a few copies of it) and the few columns kept, whatever the file's size."""
    path = write_coco_like(
        tmp_path / "big.json", num_images=2000, boxes_per_image=7, polygon_points=40
    )
    size = path.stat().st_size
    assert size > 10 * 2**20
    tracemalloc.start()
    try:
        coco = read_coco_file(path, "train_json", max_bytes=2**31)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(coco.images) == 2000 and len(coco.annotation_ids) == 14_000
    assert coco.categories == {1: "class1", 2: "class2", 3: "class3"}
    assert coco.boxes[:4].tolist() == json.loads(path.read_text())["annotations"][0]["bbox"]
    assert peak < 8 * 2**20, f"peak {peak / 2**20:.1f} MiB for a {size / 2**20:.1f} MiB file"


def test_a_coco_file_past_max_json_bytes_is_refused_before_parsing(tmp_path):
    images, entries, boxes = six_images(tmp_path)
    path = coco_file(tmp_path / "train.json", entries, boxes * 20)  # 2.4 KB
    cfg = compose_config(
        "data=coco",
        "model=detector",
        f"data.train_json={path}",
        f"data.train_images={images}",
        "data.max_json_bytes=1024",
    )
    started = time.perf_counter()
    with pytest.raises(
        DetectionDataError,
        match=r"is [\d,]+ bytes, over the limit of 1,024 .*"
        r"\(data\.train_json\): refused before parsing; raise data\.max_json_",
    ):
        build_data(cfg.data)
    assert time.perf_counter() - started < 2.0


@pytest.mark.parametrize("where", ["images", "info"])
def test_json_nested_100000_deep_is_one_error_line(tmp_path, where, capfd):
    images = image_folder(tmp_path / "images", 1)
    text = deep_json()
    if where == "info":
        text = '{"info": ' + "[" * 100_000 + "]" * 100_000 + ', "images": []}'
    (tmp_path / "deep.json").write_text(text)
    args = [
        "data=coco",
        "model=detector",
        f"data.train_json={tmp_path / 'deep.json'}",
        f"data.train_images={images}",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    code, stderr = train_main_here(capfd, *args)
    assert code == 2
    err = stderr.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"error: {tmp_path / 'deep.json'} is not valid JSON (data.train_json)")
    assert "nested deeper than the JSON reader goes" in err[0] and "(line 1, column" in err[0]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"images": [{"id": 1, "file_name": "a.png"}', "expected ',' or ']' .*line 1, column 44"),
        ('{"images": [], "annotations": [],\n "categories": [}', "Expecting value .*line 2"),
        ('{"images": {}, "annotations": [], "categories": []}', "'images' is not a list"),
        ('[{"images": []}]', "expected the file to hold a JSON object"),
        ("\udcff", "not UTF-8 text"),
    ],
)
def test_a_malformed_coco_file_is_one_error_naming_where(tmp_path, text, expected):
    path = tmp_path / "bad.json"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(DetectionDataError, match=expected):
        read_coco_file(path, "train_json", max_bytes=2**20)


def test_one_image_with_200000_boxes_keeps_the_limit_and_reports_the_rest(tmp_path):
    images, entries, boxes = six_images(tmp_path)
    crowded = [box(100 + i, 1, bbox=(i % 30, i % 20, 5, 5)) for i in range(200_000)]
    path = coco_file(tmp_path / "train.json", entries, boxes + crowded)
    started = time.perf_counter()
    bundle = coco_data(tmp_path, path, images)
    assert time.perf_counter() - started < 20
    files = bundle.report["train_files"]["annotations"]
    assert files["dropped"] == {"too_many_boxes": 200_001 - 1000}
    (record,) = [r for r in files["dropped_records"] if r["reason"] == "too_many_boxes"]
    assert record["image_id"] == 1 and record["left_out"] == 199_001
    assert "data.max_boxes_per_image=1,000: the first 1,000 kept" in record["detail"]
    boxes_of = {
        source: len(target["boxes"])
        for split in ("train", "val")
        for source, (_, target) in zip(bundle.sources[split], getattr(bundle, split), strict=True)
    }
    assert boxes_of[str(images / "img_0.png")] == 1000


def test_file_names_leading_out_of_the_images_folder_are_refused_not_read(tmp_path):
    images, entries, boxes = six_images(tmp_path)
    outside = image_folder(tmp_path / "outside", 3)
    (images / "sub").mkdir()
    (images / "sub" / "link.png").symlink_to(outside / "img_2.png")
    (images / "sub" / "inner.png").symlink_to(images / "img_5.png")  # stays inside: kept
    strays = [
        "../outside/img_0.png",
        str(outside / "img_1.png"),
        "sub/link.png",
        "sub/../../outside/img_0.png",
    ]
    entries += [{"id": 10 + i, "file_name": name} for i, name in enumerate(strays)]
    entries.append({"id": 20, "file_name": "sub\\inner.png"})  # a Windows tool's separator
    boxes += [box(10 + i, 10 + i) for i in range(len(strays))] + [box(20, 20)]
    bundle = coco_data(tmp_path, coco_file(tmp_path / "train.json", entries, boxes), images)
    report = bundle.report["train_files"]["images"]
    assert report["dropped"] == {"outside_images_root": 4}
    refused = [r for r in report["dropped_records"] if r["reason"] == "outside_images_root"]
    assert sorted(r["image_id"] for r in refused) == [10, 11, 12, 13]
    assert all("leads out of" in r["detail"] and "not read" in r["detail"] for r in refused)
    used = set(bundle.sources["train"]) | set(bundle.sources["val"])
    assert not any("outside" in os.path.realpath(p) for p in used)
    assert str(images / "sub" / "inner.png") in used
    assert bundle.report["train_files"]["annotations"]["dropped"] == {"missing_image": 4}


def yolo_tree(tmp_path, names_text: str = "names: [cat, dog]\n"):
    root = tmp_path / "yolo"
    images = image_folder(root / "images" / "train")
    (root / "labels" / "train").mkdir(parents=True)
    for i in range(6):
        (root / "labels" / "train" / f"img_{i}.txt").write_text(f"{i % 2} 0.5 0.5 0.25 0.25\n")
    (root / "data.yaml").write_text(names_text)
    return root, images


def yolo_data(tmp_path, images, *extra):
    cfg = compose_config(
        "data=yolo",
        "model=detector",
        f"data.train_dir={images}",
        f"data.cache_dir={tmp_path / 'c'}",
        *extra,
    )
    return build_data(cfg.data)


def test_a_100_mb_yolo_label_file_is_refused_from_its_size(tmp_path):
    root, images = yolo_tree(tmp_path)
    huge = root / "labels" / "train" / "img_0.txt"
    with huge.open("r+b") as f:
        f.truncate(100 * 2**20)  # sparse: 100 MB claimed, nothing written
    started = time.perf_counter()
    bundle = yolo_data(tmp_path, images)
    assert time.perf_counter() - started < 10
    report = bundle.report["train_files"]["annotations"]
    assert report["dropped"] == {"label_file": 1}
    (record,) = report["dropped_records"]
    assert record["label_file"] == str(huge)
    assert "104,857,600 bytes, over the limit of 1,048,576" in record["detail"]
    assert "data.max_label_file_bytes" in record["detail"]


def test_a_yolo_label_file_linked_out_of_its_folder_is_not_read(tmp_path):
    root, images = yolo_tree(tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_text("password hunter2\n")
    label = root / "labels" / "train" / "img_1.txt"
    label.unlink()
    label.symlink_to(secret)
    bundle = yolo_data(tmp_path, images)
    report = bundle.report["train_files"]["annotations"]
    assert report["dropped"] == {"label_file": 1}
    assert "leads out of" in report["dropped_records"][0]["detail"]
    assert "hunter2" not in json.dumps(bundle.report)


def test_a_yaml_alias_bomb_is_one_error_line(tmp_path):
    _, images = yolo_tree(tmp_path, yaml_bomb())
    tracemalloc.start()
    try:
        with pytest.raises(
            DetectionDataError,
            match=r"not YAML kiln reads .*aliases \(\*name\) "
            r"are not read",
        ):
            yolo_data(tmp_path, images)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 20 * 2**20


def test_yolo_boxes_past_the_limit_are_counted(tmp_path):
    root, images = yolo_tree(tmp_path)
    (root / "labels" / "train" / "img_0.txt").write_text("0 0.5 0.5 0.1 0.1\n" * 30)
    bundle = yolo_data(tmp_path, images, "data.max_boxes_per_image=10")
    report = bundle.report["train_files"]["annotations"]
    assert report["dropped"] == {"too_many_boxes": 20}
    assert report["annotations_read"] == 35 and report["annotations_kept"] == 15


def random_json(rng, depth: int = 0):
    if depth > 3 or rng.random() < 0.3:
        return rng.choice([1, -2.5e10, 123456789, 'a"b\\c', "é", None, True, 0.1, "", 1e-7])
    if rng.random() < 0.5:
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {f"k{i}": random_json(rng, depth + 1) for i in range(rng.randint(0, 4))}


def test_the_stream_reads_what_json_loads_reads_across_every_cut(monkeypatch):
    """Read 7 characters at a time, every value is cut somewhere (a number's exponent, a
    string's escape): what the stream gives is what json.loads gives."""
    import io
    import random

    from kiln.data import json_stream

    monkeypatch.setattr(json_stream, "CHUNK_CHARS", 7)
    rng = random.Random(0)
    for _ in range(1500):
        document = {f"m{j}": random_json(rng) for j in range(rng.randint(0, 5))}
        text = json.dumps(document, indent=rng.choice([None, 1, 4]))
        stream, read = json_stream.JsonStream(io.StringIO(text), 10**6), {}
        for key in stream.members():
            read[key] = list(stream.elements()) if stream.next_is_array() else stream.value()
        assert read == document, text


def test_a_mistake_early_in_a_large_file_is_named_where_it_is(tmp_path, monkeypatch):
    """A decode error well before the buffer's end is the file's own: named at once, not read
    on until the element limit (1 MiB here) and then blamed on the size."""
    from kiln.data import coco

    monkeypatch.setattr(coco, "MAX_ELEMENT_CHARS", 2**20)
    images = ",".join(json.dumps({"id": i, "file_name": f"{i}.png"}) for i in range(60_000))
    path = tmp_path / "bad.json"
    path.write_text('{"images": [{"id": 1,, "file_name": "a.png"}, ' + images + "]}")
    assert path.stat().st_size > 2 * 2**20
    expected = r"Expecting property name .*\(line 1, column 22\)"
    with pytest.raises(DetectionDataError, match=expected):
        read_coco_file(path, "train_json", max_bytes=2**30)
