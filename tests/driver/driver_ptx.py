"""Hand-written PTX for the driver tests: deliberately not from the DSL, so the
driver is also tested on PTX that ptxgen did not emit (tests/driver/test_dsl_kernels_gpu.py
runs the DSL's own vector add and block reduction through the driver)."""

VADD_PTX = """\
.version 7.0
.target sm_80
.address_size 64

// c[i] = a[i] + b[i] for i < n
.visible .entry vadd(
    .param .u64 .ptr .global .align 4 a,
    .param .u64 .ptr .global .align 4 b,
    .param .u64 .ptr .global .align 4 c,
    .param .u32 n
)
{
    .reg .pred %p<2>;
    .reg .b32 %r<6>;
    .reg .f32 %f<4>;
    .reg .b64 %rd<11>;

    ld.param.u64 %rd1, [a];
    ld.param.u64 %rd2, [b];
    ld.param.u64 %rd3, [c];
    ld.param.u32 %r1, [n];
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mad.lo.s32 %r5, %r2, %r3, %r4;
    setp.ge.u32 %p1, %r5, %r1;
    @%p1 bra DONE;
    cvta.to.global.u64 %rd4, %rd1;
    cvta.to.global.u64 %rd5, %rd2;
    cvta.to.global.u64 %rd6, %rd3;
    mul.wide.u32 %rd7, %r5, 4;
    add.s64 %rd8, %rd4, %rd7;
    add.s64 %rd9, %rd5, %rd7;
    add.s64 %rd10, %rd6, %rd7;
    ld.global.f32 %f1, [%rd8];
    ld.global.f32 %f2, [%rd9];
    add.f32 %f3, %f1, %f2;
    st.global.f32 [%rd10], %f3;
DONE:
    ret;
}
"""

EMPTY_PTX = """\
.version 7.0
.target sm_80
.address_size 64

.visible .entry empty()
{
    ret;
}
"""

# out[blockIdx.x] = sum of x[blockIdx.x * ntid + t] (t < ntid, index < n); ntid a power of two <= 256
BLOCK_SUM_PTX = """\
.version 7.0
.target sm_80
.address_size 64

.visible .entry block_sum(
    .param .u64 .ptr .global .align 4 x,
    .param .u64 .ptr .global .align 4 out,
    .param .u32 n
)
{
    .reg .pred %p<4>;
    .reg .b32 %r<12>;
    .reg .f32 %f<4>;
    .reg .b64 %rd<7>;
    .shared .align 4 .f32 sdata[256];

    ld.param.u64 %rd1, [x];
    ld.param.u64 %rd2, [out];
    ld.param.u32 %r1, [n];
    cvta.to.global.u64 %rd1, %rd1;
    cvta.to.global.u64 %rd2, %rd2;
    mov.u32 %r2, %tid.x;
    mov.u32 %r3, %ctaid.x;
    mov.u32 %r4, %ntid.x;
    mad.lo.s32 %r5, %r3, %r4, %r2;
    mov.f32 %f1, 0f00000000;
    setp.ge.u32 %p1, %r5, %r1;
    @%p1 bra STORE;
    mul.wide.u32 %rd3, %r5, 4;
    add.s64 %rd4, %rd1, %rd3;
    ld.global.f32 %f1, [%rd4];
STORE:
    mov.u32 %r6, sdata;
    shl.b32 %r7, %r2, 2;
    add.s32 %r8, %r6, %r7;
    st.shared.f32 [%r8], %f1;
    bar.sync 0;
    shr.u32 %r9, %r4, 1;
LOOP:
    setp.eq.u32 %p2, %r9, 0;
    @%p2 bra REDUCED;
    setp.ge.u32 %p3, %r2, %r9;
    @%p3 bra SKIP;
    shl.b32 %r10, %r9, 2;
    add.s32 %r11, %r8, %r10;
    ld.shared.f32 %f2, [%r11];
    ld.shared.f32 %f3, [%r8];
    add.f32 %f3, %f3, %f2;
    st.shared.f32 [%r8], %f3;
SKIP:
    bar.sync 0;
    shr.u32 %r9, %r9, 1;
    bra LOOP;
REDUCED:
    setp.ne.u32 %p1, %r2, 0;
    @%p1 bra END;
    ld.shared.f32 %f2, [sdata];
    mul.wide.u32 %rd5, %r3, 4;
    add.s64 %rd6, %rd2, %rd5;
    st.global.f32 [%rd6], %f2;
END:
    ret;
}
"""
