// Sum of one vec4 per invocation over a workgroup of THREADS = SUM_ROWS² invocations.
// Included by kernels that define THREADS (256).
const SUM_ROWS: u32 = 16u;

var<workgroup> sum_in: array<vec4<f32>, THREADS>;
var<workgroup> sum_rows: array<vec4<f32>, SUM_ROWS>;
var<workgroup> sum_total: vec4<f32>;

// Component-wise sum of one vec4 per invocation; every invocation gets the same total. SUM_ROWS
// invocations add a row of SUM_ROWS values each, then one adds the rows: three barriers, where a
// tree needs log2(THREADS). A second call may follow at once: its stores come before barriers that
// every invocation reaches only after reading this total.
fn workgroup_sum(lid: u32, value: vec4<f32>) -> vec4<f32> {
  sum_in[lid] = value;
  workgroupBarrier();
  if (lid < SUM_ROWS) {
    var row = sum_in[lid * SUM_ROWS];
    for (var m = 1u; m < SUM_ROWS; m++) {
      row += sum_in[lid * SUM_ROWS + m];
    }
    sum_rows[lid] = row;
  }
  workgroupBarrier();
  if (lid == 0u) {
    var total = sum_rows[0];
    for (var m = 1u; m < SUM_ROWS; m++) {
      total += sum_rows[m];
    }
    sum_total = total;
  }
  workgroupBarrier();
  return sum_total;
}
