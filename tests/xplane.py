"""Reads a profiler trace's `.xplane.pb` (tsl's `XSpace` protobuf) without its generated classes.

Neither `tensorboard_plugin_profile` / `xprof` nor the `xplane_pb2` module ship in the test venv,
so this decodes the protobuf wire format directly, keeping the fields the tests look at
(tsl/profiler/protobuf/xplane.proto): XSpace.planes = 1; XPlane.name = 2, .lines = 3,
.event_metadata = 4 (map<int64, XEventMetadata>), .stat_metadata = 5; XLine.name = 2, .events = 4;
XEvent.metadata_id = 1, .stats = 4; XEventMetadata.name = 2; XStatMetadata.name = 2;
XStat.metadata_id = 1, .uint64_value = 3, .int64_value = 4, .str_value = 5, .ref_value = 7 (the
name of a stat metadata entry: an interned string).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, i
        shift += 7


def fields(buf: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of one message: varints as int, length-delimited as bytes."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 2:
            n, i = _varint(buf, i)
            value, i = buf[i : i + n], i + n
        elif wire == 1:
            value, i = int.from_bytes(buf[i : i + 8], "little"), i + 8
        elif wire == 5:
            value, i = int.from_bytes(buf[i : i + 4], "little"), i + 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
        yield number, value


@dataclasses.dataclass
class Event:
    name: str
    line: str
    stats: dict[str, int | str]


@dataclasses.dataclass
class Plane:
    name: str
    events: list[Event]
    event_names: set[str]  # every event metadata name, used or not
    # event metadata name -> its serialized XEventMetadata (the metadata plane's entries hold a
    # program's HloProto: every op with its op_name, the jax.named_scope path)
    metadata: dict[str, bytes]


def _map_entry(buf: bytes) -> tuple[int, bytes]:
    key, value = 0, b""
    for n, v in fields(buf):
        if n == 1:
            key = v
        elif n == 2:
            value = v
    return key, value


def _name(buf: bytes) -> str:
    return next((v.decode() for n, v in fields(buf) if n == 2), "")


def read_planes(path: str) -> list[Plane]:
    with open(path, "rb") as f:
        space = f.read()
    planes = []
    for n, plane in fields(space):
        if n != 1:
            continue
        name, lines, event_meta, stat_meta, raw_meta = "", [], {}, {}, {}
        for m, v in fields(plane):
            if m == 2:
                name = v.decode()
            elif m == 3:
                lines.append(v)
            elif m == 4:
                key, meta = _map_entry(v)
                event_meta[key] = _name(meta)
                raw_meta[event_meta[key]] = meta
            elif m == 5:
                key, meta = _map_entry(v)
                stat_meta[key] = _name(meta)
        events = []
        for line in lines:
            line_name, raw_events = "", []
            for m, v in fields(line):
                if m == 2:
                    line_name = v.decode()
                elif m == 4:
                    raw_events.append(v)
            for raw in raw_events:
                meta_id, stats = 0, {}
                for m, v in fields(raw):
                    if m == 1:
                        meta_id = v
                    elif m == 4:
                        stat_id, value = 0, None
                        for k, sv in fields(v):
                            if k == 1:
                                stat_id = sv
                            elif k in (3, 4):
                                value = sv
                            elif k == 5:
                                value = sv.decode()
                            elif k == 7:
                                value = stat_meta.get(sv, "")
                        stats[stat_meta.get(stat_id, str(stat_id))] = value
                events.append(Event(event_meta.get(meta_id, ""), line_name, stats))
        planes.append(Plane(name, events, set(event_meta.values()), raw_meta))
    return planes
