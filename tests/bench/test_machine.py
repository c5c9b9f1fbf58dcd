"""bench/record.py's machine identity: the microarchitecture a results file is tagged with."""

from __future__ import annotations

from bench.record import cpu_label, cpuinfo_fields, microarch

AMD = "AuthenticAMD"


def test_amd_family_25_splits_into_zen3_and_zen4_by_model() -> None:
    assert microarch(AMD, 25, 1, "AMD EPYC") == "zen3"  # Milan
    assert microarch(AMD, 25, 0x21, "AMD EPYC") == "zen3"  # Vermeer
    assert microarch(AMD, 25, 0x5F, "AMD EPYC") == "zen3"
    assert microarch(AMD, 25, 17, "AMD EPYC") == "zen4"  # Genoa
    assert microarch(AMD, 25, 0x61, "AMD EPYC") == "zen4"  # Raphael
    assert microarch(AMD, 25, 0xA0, "AMD EPYC") == "zen4"  # Bergamo


def test_amd_family_26_is_zen5() -> None:
    assert microarch(AMD, 26, 2, "AMD EPYC") == "zen5"
    assert microarch(AMD, 26, 0x44, "AMD Ryzen 9 9950X 16-Core Processor") == "zen5"


def test_intel_xeons_with_amx_are_named_by_model() -> None:
    assert microarch("GenuineIntel", 6, 143, "Intel(R) Xeon(R) Platinum 8481C CPU") == "sapphire-rapids"
    assert microarch("GenuineIntel", 6, 207, "Intel(R) Xeon(R) Processor") == "emerald-rapids"
    assert microarch("GenuineIntel", 6, 0xAD, "Intel(R) Xeon(R) 6") == "granite-rapids"


def test_anything_else_is_a_slug_of_its_name() -> None:
    name = "Intel(R) Xeon(R) Platinum 8380 CPU @ 2.30GHz"  # Ice Lake: no AMX, not named
    assert microarch("GenuineIntel", 6, 106, name) == "intel-r-xeon-r-platinum-8380-cpu"
    assert len(microarch("GenuineIntel", 6, 106, name)) == 32
    # A family-25 model outside both ranges, and a missing model, are not guessed at.
    assert microarch(AMD, 25, 0x90, "AMD EPYC 1234") == "amd-epyc-1234"
    assert microarch(AMD, 25, None, "AMD EPYC") == "amd-epyc"
    assert microarch("unknown", None, None, "") == "cpu"
    assert microarch("unknown", None, None, "!!!") == "cpu"


def test_cpuinfo_fields_are_the_first_processors() -> None:
    text = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
            "model name\t: AMD EPYC\nflags\t\t: fpu sse avx2\n\n"
            "processor\t: 1\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 99\n")
    fields = cpuinfo_fields(text)
    assert fields["processor"] == "0" and fields["model"] == "17" and fields["model name"] == "AMD EPYC"
    assert fields["cpu family"] == "25" and fields["vendor_id"] == "AuthenticAMD"


def test_the_machine_line_names_the_microarch_and_reads_older_records() -> None:
    assert cpu_label({"cpu": "AMD EPYC", "microarch": "zen4"}) == "AMD EPYC (zen4)"
    assert cpu_label({"cpu": "AMD EPYC"}) == "AMD EPYC"  # recorded before microarch was
    # A part without a known microarchitecture is named by its name's slug: said once, not twice.
    name = "Intel(R) Xeon(R) Platinum 8380 CPU @ 2.30GHz"
    assert cpu_label({"cpu": name, "microarch": microarch("GenuineIntel", 6, 106, name)}) == name
    assert cpu_label({"cpu": "Intel(R) Xeon(R) Processor", "microarch": "emerald-rapids"}) == (
        "Intel(R) Xeon(R) Processor (emerald-rapids)")
