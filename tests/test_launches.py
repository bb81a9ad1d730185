"""maverick.launches: kernel launches counted from XLA:GPU thunk sequence dumps, on hand-written
samples in the format jax 0.12's XLA writes (lines copied from a real deviceless H200 compile of the
decode step, with the nesting cut down). Expected counts are worked out by hand in the comments."""

from maverick import launches

# An outer loop (10 trips) whose body runs a Mosaic kernel, an inner loop (3 trips) and an
# all-reduce; a pad before and an add after; a stream wait (not a launch).
NESTED = """\
000: kCommandBuffer [source | sink] 
    001: kCustomKernel [source        | next=002 (1) ] loop_pad_fusion.8 grid: [640, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
    002: kWhile        [prev=001 (1)  | next=011 (1) ]       
condition:
        003: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
      body:
        004: kCustomCall   [source       | next=005 (1)] kCustomCall
        005: kWhile        [prev=004 (1) | next=009 (1)]       
condition:
            006: kCustomKernel [source | sink] loop_compare_fusion.1 grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
          body:
            007: kCopy         [source       | next=008 (1)] kCopy
            008: kCustomKernel [prev=007 (1) | sink        ] input_reduce_fusion.3 grid: [1, 1, 1] threads: [64, 1, 1]  shared_memory: 0 bytes
        009: kAllReduceStart [prev=005 (1) | next=010 (1)] kAllReduceStart
        010: kWaitForStreams [prev=009 (1) | sink] kWaitForStreams
    011: kCustomKernel [prev=002 (1)  | sink         ] loop_add_fusion_1 grid: [40, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
"""

METADATA = """\
thunk_metadata {
  thunk_info {
    profile_annotation: "command_buffer_1"
  }
  thunk_kind: "kCommandBuffer"
}
thunk_metadata {
  thunk_info {
    profile_annotation: "while.69"
    thunk_id: 2
  }
  thunk_kind: "kWhile"
}
thunk_metadata {
  thunk_info {
    profile_annotation: "while.7"
    thunk_id: 5
  }
  thunk_kind: "kWhile"
}
"""

HLO = """\
  %while.69 = (s32[], s32[129]{0}) while(%tuple.98), condition=%region_34, body=%region_33, metadata={op_name="jit(step)/while"}, backend_config={"known_induction_variable":{"tuple_index":"0"},"known_trip_count":{"n":"10"}}
  %while.7 = (s32[], u32[4]{0}) while(%tuple.9), condition=%region_4, body=%region_3, backend_config={"known_trip_count":{"n":"3"}}
  %while.8 = (s32[]) while(%tuple.10), condition=%region_5, body=%region_6
"""


def test_trip_counts_come_from_the_hlo_while_behind_each_thunk():
  assert launches.trip_counts(METADATA, HLO) == {2: 10, 5: 3}


def test_nested_loops_count_each_body_times_its_trips_and_each_condition_once_more():
  got = launches.count(NESTED, {2: 10, 5: 3})
  # outer condition 11; per outer trip: mosaic 1, inner condition 4, inner body 3 x (copy, reduce),
  # all-reduce 1 (the stream wait is not a launch); pad and add once.
  assert got.by_kind == {"compare": 11 + 10 * 4, "copy": 30, "reduce": 30, "mosaic": 10,
                         "collective": 10, "pad": 1, "add": 1}
  assert got.total == 133 and got.unknown_trip_whiles == 0
  assert got.per_layer(7) == 133 / 7


def test_a_loop_without_a_known_trip_count_counts_once_and_is_reported():
  got = launches.count(NESTED, {2: 10})
  # inner loop as 1 trip: condition 2, body 1 per outer trip
  assert got.by_kind["compare"] == 11 + 10 * 2 and got.by_kind["copy"] == 10
  assert got.total == 73 and got.unknown_trip_whiles == 1


def test_one_iteration_of_the_main_loop():
  assert launches.main_loop(NESTED) == 2
  got = launches.count(NESTED, {2: 10, 5: 3}, per_iteration_of=2)
  # outer condition once, mosaic, inner condition 4, inner body 3 x 2, all-reduce: 13
  assert got.by_kind == {"compare": 5, "copy": 3, "reduce": 3, "mosaic": 1, "collective": 1}
  assert got.total == 13


def test_a_program_without_loops():
  flat = "\n".join(NESTED.splitlines()[:2] + NESTED.splitlines()[-1:])
  assert launches.main_loop(flat) is None
  assert launches.count(flat).by_kind == {"pad": 1, "add": 1}


def test_kinds_name_what_each_kernel_does():
  k = launches.kind_of
  assert k("kCustomKernel", "loop_pad_fusion.8 grid: [640, 1, 1]") == "pad"
  assert k("kCustomKernel", "input_reduce_fusion_16") == "reduce"
  assert k("kCustomKernel", "loop_dynamic_update_slice_fusion.1") == "dynamic_update_slice"
  assert k("kCustomKernel", "gemm_fusion_dot.3") == "gemm"
  assert k("kCustomKernel", "sort.15.0") == "sort"
  assert k("kCustomKernel", "wrapped_iota") == "iota"
  assert k("kCustomCall", "kCustomCall") == "mosaic"
  assert k("kCopy", "kCopy") == "copy"
  assert k("kAllGather", "kAllGather") == "collective"
  assert k("kMemset32BitValue", "") == "memset"
  assert k("kPartitionId", "kPartitionId") == "partitionid"


# A conditional (a sampling filter, or a copy when skipped) whose false branch ends with another
# conditional; the labels' format is XLA's.
CONDITIONAL = """\
000: kCommandBuffer [source | sink] 
    104: kCustomKernel [prev=080 (14) | next=167 (1) ] loop_compare_fusion_26 grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
    167: kConditional  [prev=104 (1)  | next=169 (2) ]       
      false_branch:
        105: kCustomKernel [source       | next=114 (2)] loop_divide_fusion_4 grid: [198, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
        115: kCustomKernel [prev=114 (1) | next=159 (1)] loop_or_fusion_14 grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
        114: kConditional  [prev=106 (1) | next=115 (1)]           
          false_branch:
            107: kCustomKernel [source       | next=108 (1)] input_reduce_fusion_1 grid: [20, 1, 1] threads: [256, 1, 1]  shared_memory: 0 bytes
            109: kAsyncStart   [prev=108 (1) | next=112 (2)] stream=computation_stream[0], async_id=109
                110: kCollectiveKernel [source | sink] kCollectiveKernel
            111: kAsyncDone    [source       | sink        ] async_id=109
          true_branch:
            113: kCopy [source | sink] kCopy
      true_branch:
        116: kCopy [source | sink] kCopy
    169: kCustomKernel [prev=167 (1)  | sink         ] loop_add_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
"""


def test_a_conditional_counts_its_smallest_branch_and_largest_its_largest():
  got = launches.count(CONDITIONAL)
  # compare + (outer true branch: copy) + add
  assert got.by_kind == {"compare": 1, "copy": 1, "add": 1} and got.total == 3
  # compare + divide + or + (inner false: reduce, collective) + add: the stream events are not
  # launches; the outer "true_branch:" right after the inner conditional's last thunk is the
  # outer one's (by its indent)
  assert got.largest == 6
