//! The e4m3fn rules, checked against an independent construction of the format.

use tierkv_kernels::cpu::numerics::{e4m3_decode, e4m3_encode};

/// e4m3fn by definition: 1 sign, 4 exponent (bias 7), 3 mantissa bits; exponent 0 is subnormal
/// (`m/8 · 2^-6`); `S.1111.111` is NaN; there are no infinities.
fn decode_by_definition(code: u8) -> f64 {
    let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((code >> 3) & 0xF) as i32;
    let m = (code & 7) as f64;
    if code & 0x7F == 0x7F {
        return f64::NAN;
    }
    if e == 0 {
        sign * (m / 8.0) * 2f64.powi(-6)
    } else {
        sign * (1.0 + m / 8.0) * 2f64.powi(e - 7)
    }
}

#[test]
fn all_256_codes_decode_as_specified() {
    for code in 0..=255u8 {
        let want = decode_by_definition(code);
        let got = e4m3_decode(code) as f64;
        if want.is_nan() {
            assert!(got.is_nan(), "code {code:#04x}");
        } else {
            assert_eq!(got, want, "code {code:#04x}");
        }
    }
    assert_eq!(e4m3_decode(0x7E), 448.0);
    assert_eq!(e4m3_decode(0x01), 2f32.powi(-9));
}

/// The nearest finite code by brute force, ties to the even code, saturating at ±448.
fn encode_by_search(x: f32) -> u8 {
    let x = x as f64;
    let mut best = 0u8;
    let mut best_err = f64::INFINITY;
    for code in 0..=255u8 {
        let v = decode_by_definition(code);
        if v.is_nan() || (v == 0.0 && code == 0x80) {
            continue;
        }
        let err = (v - x).abs();
        if err < best_err || (err == best_err && code & 1 == 0 && best & 1 == 1) {
            best = code;
            best_err = err;
        }
    }
    if x.is_sign_negative() && decode_by_definition(best) == 0.0 {
        return 0x80;
    }
    best
}

#[test]
fn encode_rounds_to_nearest_even_and_saturates() {
    // Every midpoint between neighbouring positive codes, and just either side of it.
    for code in 0..0x7Eu8 {
        let (a, b) = (decode_by_definition(code), decode_by_definition(code + 1));
        let mid = ((a + b) / 2.0) as f32;
        let even = if code & 1 == 0 { code } else { code + 1 };
        assert_eq!(e4m3_encode(mid), even, "midpoint after {code:#04x}");
        assert_eq!(
            e4m3_encode(-mid),
            even | 0x80,
            "negative midpoint after {code:#04x}"
        );
        let below = f32::from_bits(mid.to_bits() - 1);
        let above = f32::from_bits(mid.to_bits() + 1);
        assert_eq!(e4m3_encode(below), code);
        assert_eq!(e4m3_encode(above), code + 1);
    }
    for x in [
        448.0f32,
        449.0,
        463.9,
        464.0,
        465.0,
        1e6,
        f32::MAX,
        f32::INFINITY,
    ] {
        assert_eq!(e4m3_encode(x), 0x7E, "{x} saturates to 448");
        assert_eq!(e4m3_encode(-x), 0xFE, "-{x} saturates to -448");
    }
    // A sweep of ordinary values against the brute-force search.
    let mut s = 0x1234_5678_9abc_def0u64;
    for _ in 0..20_000 {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let mant = ((s >> 40) as f32) / (1u64 << 24) as f32;
        let exp = ((s >> 8) % 24) as i32 - 14;
        let sign = if s & 1 == 0 { 1.0 } else { -1.0 };
        let x = sign * mant * 2f32.powi(exp);
        assert_eq!(e4m3_encode(x), encode_by_search(x), "x = {x:e}");
    }
}

/// The bit-arithmetic encoder equals the `float8` crate's (the encoder the kernels were first
/// checked bit-exact on the H200 with) on every f32 bit pattern in a stride of 251, and on every
/// pattern near each code's rounding boundaries; `TIERKV_EXHAUSTIVE=1` checks all 2^32 of them.
#[test]
fn encode_equals_the_float8_crate() {
    use tierkv_kernels::cpu::numerics::e4m3_encode_float8;
    let check = |bits: u32| {
        let x = f32::from_bits(bits);
        assert_eq!(
            e4m3_encode(x),
            e4m3_encode_float8(x),
            "{x:e} (bits {bits:#010x})"
        );
    };
    let exhaustive = match std::env::var("TIERKV_EXHAUSTIVE").as_deref() {
        Ok("1") => true,
        Ok("0") | Err(std::env::VarError::NotPresent) => false,
        other => panic!("TIERKV_EXHAUSTIVE={other:?}: give 1 (every pattern) or 0"),
    };
    if exhaustive {
        (0..=u32::MAX).for_each(check);
        return;
    }
    (0..=u32::MAX).step_by(251).for_each(check);
    // Saturation: every f32 from 448 to 480 (464 is the tie), the infinities, NaNs, both signs.
    for bits in 448f32.to_bits()..=480f32.to_bits() {
        check(bits);
        check(bits | 0x8000_0000);
    }
    for x in [
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        f32::MAX,
        f32::MIN,
    ] {
        check(x.to_bits());
    }
    // Around every code's value and every midpoint between neighbours, both signs.
    for code in 0..0x7Fu32 {
        for v in [
            e4m3_decode(code as u8),
            (e4m3_decode(code as u8) + e4m3_decode(code as u8 + 1)) / 2.0,
        ] {
            let b = v.to_bits();
            for d in 0..64u32 {
                for bits in [b.wrapping_add(d), b.wrapping_sub(d)] {
                    check(bits);
                    check(bits | 0x8000_0000);
                }
            }
        }
    }
}
