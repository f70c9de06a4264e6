//! Kubernetes resource quantities (`resource.Quantity`), parsed once into an exact integer.
//!
//! A [`Quantity`] holds its value in nano-units (10^-9) as an `i128`, which represents every
//! quantity Kubernetes accepts up to `Ei` multiples exactly; values finer than a nano-unit are
//! rounded up, as the API server does when it canonicalizes. The suffix family the value was
//! written in (binary SI, decimal SI or decimal exponent) is kept so that [`Quantity`]'s
//! `Display` prints the canonical string Kubernetes would print.

use std::cmp::Ordering;
use std::fmt;
use std::str::FromStr;

/// One unit in the internal representation.
const NANO: i128 = 1_000_000_000;
/// Largest magnitude accepted, in nano-units: about 1.7e29 units, well beyond `8Ei`.
const LIMIT: i128 = i128::MAX / 1_000_000;

/// The suffix family a quantity was written in; it decides the canonical output form.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Format {
    /// `Ki`, `Mi`, ... `Ei`.
    BinarySi,
    /// `e3`, `E-3`, ...
    DecimalExponent,
    /// `m`, none, `k`, `M`, ... `E`.
    #[default]
    DecimalSi,
}

/// An exact Kubernetes quantity.
#[derive(Debug, Clone, Copy, Default)]
pub struct Quantity {
    nanos: i128,
    format: Format,
}

/// Why a string is not a quantity.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantityError {
    /// No digits.
    #[error("quantity {0:?} is empty or has no digits")]
    NoDigits(String),
    /// An unknown suffix.
    #[error("quantity {0:?} has an unknown suffix")]
    BadSuffix(String),
    /// Beyond the largest magnitude accepted.
    #[error("quantity {0:?} is out of range")]
    OutOfRange(String),
}

impl Quantity {
    /// Zero.
    pub const ZERO: Quantity = Quantity {
        nanos: 0,
        format: Format::DecimalSi,
    };

    /// Parses the Kubernetes quantity grammar: `<sign><digits>[.<digits>]<suffix>`.
    pub fn parse(s: &str) -> Result<Quantity, QuantityError> {
        let t = s.trim();
        let bytes = t.as_bytes();
        let mut i = 0;
        let mut negative = false;
        if i < bytes.len() && (bytes[i] == b'+' || bytes[i] == b'-') {
            negative = bytes[i] == b'-';
            i += 1;
        }
        let mut mantissa: i128 = 0;
        let mut frac_digits: i32 = 0;
        let mut digits = 0;
        let mut seen_dot = false;
        // Digits beyond what fits are only allowed after the dot, where they round up.
        let mut truncated_nonzero = false;
        while i < bytes.len() {
            let c = bytes[i];
            if c.is_ascii_digit() {
                digits += 1;
                if mantissa < LIMIT / 10 && frac_digits < 30 {
                    mantissa = mantissa * 10 + i128::from(c - b'0');
                    if seen_dot {
                        frac_digits += 1;
                    }
                } else if seen_dot {
                    truncated_nonzero |= c != b'0';
                } else {
                    return Err(QuantityError::OutOfRange(s.to_string()));
                }
            } else if c == b'.' && !seen_dot {
                seen_dot = true;
            } else {
                break;
            }
            i += 1;
        }
        if digits == 0 {
            return Err(QuantityError::NoDigits(s.to_string()));
        }
        let suffix = &t[i..];
        // (multiplier numerator, decimal exponent) in units.
        let (format, mult, exp10): (Format, i128, i32) = match suffix {
            "" => (Format::DecimalSi, 1, 0),
            "n" => (Format::DecimalSi, 1, -9),
            "u" => (Format::DecimalSi, 1, -6),
            "m" => (Format::DecimalSi, 1, -3),
            "k" => (Format::DecimalSi, 1, 3),
            "M" => (Format::DecimalSi, 1, 6),
            "G" => (Format::DecimalSi, 1, 9),
            "T" => (Format::DecimalSi, 1, 12),
            "P" => (Format::DecimalSi, 1, 15),
            "E" => (Format::DecimalSi, 1, 18),
            "Ki" => (Format::BinarySi, 1 << 10, 0),
            "Mi" => (Format::BinarySi, 1 << 20, 0),
            "Gi" => (Format::BinarySi, 1 << 30, 0),
            "Ti" => (Format::BinarySi, 1 << 40, 0),
            "Pi" => (Format::BinarySi, 1 << 50, 0),
            "Ei" => (Format::BinarySi, 1 << 60, 0),
            _ => {
                let rest = suffix
                    .strip_prefix('e')
                    .or_else(|| suffix.strip_prefix('E'))
                    .ok_or_else(|| QuantityError::BadSuffix(s.to_string()))?;
                let e: i32 = rest
                    .parse()
                    .map_err(|_| QuantityError::BadSuffix(s.to_string()))?;
                if !(-40..=40).contains(&e) {
                    return Err(QuantityError::OutOfRange(s.to_string()));
                }
                (Format::DecimalExponent, 1, e)
            }
        };
        // value = mantissa * mult * 10^(exp10 - frac_digits); in nanos: * 10^9.
        let shift = exp10 - frac_digits + 9;
        let scaled = mantissa
            .checked_mul(mult)
            .ok_or_else(|| QuantityError::OutOfRange(s.to_string()))?;
        let nanos = if shift >= 0 {
            let p = 10i128
                .checked_pow(shift as u32)
                .ok_or_else(|| QuantityError::OutOfRange(s.to_string()))?;
            scaled
                .checked_mul(p)
                .ok_or_else(|| QuantityError::OutOfRange(s.to_string()))?
        } else {
            let p = 10i128
                .checked_pow((-shift) as u32)
                .ok_or_else(|| QuantityError::OutOfRange(s.to_string()))?;
            let q = scaled / p;
            // Kubernetes rounds values below its smallest scale up (away from zero).
            if scaled % p != 0 || truncated_nonzero {
                q + 1
            } else {
                q
            }
        };
        if nanos > LIMIT {
            return Err(QuantityError::OutOfRange(s.to_string()));
        }
        Ok(Quantity {
            nanos: if negative { -nanos } else { nanos },
            format,
        })
    }

    /// A whole number of units in decimal SI format.
    pub fn from_units(units: i64) -> Quantity {
        Quantity {
            nanos: i128::from(units) * NANO,
            format: Format::DecimalSi,
        }
    }

    /// A whole number of milli-units in decimal SI format (CPU millicores).
    pub fn from_milli(milli: i64) -> Quantity {
        Quantity {
            nanos: i128::from(milli) * 1_000_000,
            format: Format::DecimalSi,
        }
    }

    /// Builds from nano-units, keeping the given output format.
    pub fn from_nanos(nanos: i128, format: Format) -> Quantity {
        Quantity { nanos, format }
    }

    /// The value in nano-units.
    pub fn nanos(&self) -> i128 {
        self.nanos
    }

    /// The format the value is printed in.
    pub fn format(&self) -> Format {
        self.format
    }

    /// The same value, printed in another format.
    pub fn with_format(self, format: Format) -> Quantity {
        Quantity { format, ..self }
    }

    /// True for zero.
    pub fn is_zero(&self) -> bool {
        self.nanos == 0
    }

    /// Value in milli-units, rounded up (Kubernetes `MilliValue`).
    pub fn milli_ceil(&self) -> i128 {
        div_ceil(self.nanos, 1_000_000)
    }

    /// Value in whole units, rounded up (Kubernetes `Value`).
    pub fn units_ceil(&self) -> i128 {
        div_ceil(self.nanos, NANO)
    }

    /// True when the value is a whole number of units.
    pub fn is_integer(&self) -> bool {
        self.nanos.rem_euclid(NANO) == 0
    }

    /// The value as an `i64` of units when it is whole and fits (CEL `asInteger`).
    pub fn as_i64(&self) -> Option<i64> {
        if self.is_integer() {
            i64::try_from(self.nanos / NANO).ok()
        } else {
            None
        }
    }

    /// The value in units, approximately.
    pub fn as_f64(&self) -> f64 {
        self.nanos as f64 / NANO as f64
    }

    /// Sum; the format of `self` wins, as in Kubernetes' `Add`.
    pub fn checked_add(self, other: Quantity) -> Option<Quantity> {
        let nanos = self.nanos.checked_add(other.nanos)?;
        (nanos.abs() <= LIMIT).then_some(Quantity {
            nanos,
            format: self.format,
        })
    }

    /// Difference; `None` out of range. The format of `self` wins.
    pub fn checked_sub(self, other: Quantity) -> Option<Quantity> {
        let nanos = self.nanos.checked_sub(other.nanos)?;
        (nanos.abs() <= LIMIT).then_some(Quantity {
            nanos,
            format: self.format,
        })
    }

    /// Saturating sum (capacity accounting never needs values near the limit).
    pub fn saturating_add(self, other: Quantity) -> Quantity {
        Quantity {
            nanos: self.nanos.saturating_add(other.nanos).clamp(-LIMIT, LIMIT),
            format: self.format,
        }
    }

    /// Saturating difference.
    pub fn saturating_sub(self, other: Quantity) -> Quantity {
        Quantity {
            nanos: self.nanos.saturating_sub(other.nanos).clamp(-LIMIT, LIMIT),
            format: self.format,
        }
    }

    /// `self * n`, saturating.
    pub fn saturating_mul(self, n: i64) -> Quantity {
        Quantity {
            nanos: self
                .nanos
                .saturating_mul(i128::from(n))
                .clamp(-LIMIT, LIMIT),
            format: self.format,
        }
    }

    /// How many whole `per` fit in `self` (0 when `per` is not positive or `self` is negative).
    pub fn fits(&self, per: &Quantity) -> i64 {
        if per.nanos <= 0 || self.nanos <= 0 {
            return if per.nanos <= 0 { i64::MAX } else { 0 };
        }
        i64::try_from(self.nanos / per.nanos).unwrap_or(i64::MAX)
    }
}

fn div_ceil(a: i128, b: i128) -> i128 {
    let q = a / b;
    if a % b != 0 && (a > 0) == (b > 0) {
        q + 1
    } else {
        q
    }
}

impl PartialEq for Quantity {
    fn eq(&self, other: &Self) -> bool {
        self.nanos == other.nanos
    }
}
impl Eq for Quantity {}
impl std::hash::Hash for Quantity {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.nanos.hash(state)
    }
}
impl PartialOrd for Quantity {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Quantity {
    fn cmp(&self, other: &Self) -> Ordering {
        self.nanos.cmp(&other.nanos)
    }
}

impl FromStr for Quantity {
    type Err = QuantityError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Quantity::parse(s)
    }
}

impl fmt::Display for Quantity {
    /// Canonical form, as Kubernetes' `Quantity.String()` prints it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sign = if self.nanos < 0 { "-" } else { "" };
        let n = self.nanos.unsigned_abs();
        if n == 0 {
            return f.write_str("0");
        }
        let whole = n.is_multiple_of(NANO as u128);
        if self.format == Format::BinarySi && whole {
            let units = n / NANO as u128;
            // Largest binary suffix that divides the value; below 1024 fall back to decimal.
            const SUFFIX: [&str; 7] = ["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"];
            let mut v = units;
            let mut k = 0;
            while k < 6 && v >= 1024 && v.is_multiple_of(1024) {
                v /= 1024;
                k += 1;
            }
            if k > 0 || units < 1024 {
                return write!(f, "{sign}{v}{}", SUFFIX[k]);
            }
        }
        // Decimal: an integer mantissa with an exponent that is a multiple of 3, >= -9.
        let mut mantissa = n;
        let mut exp: i32 = -9;
        while mantissa.is_multiple_of(1000) && exp < 18 {
            mantissa /= 1000;
            exp += 3;
        }
        if self.format == Format::DecimalExponent {
            return if exp == 0 {
                write!(f, "{sign}{mantissa}")
            } else {
                write!(f, "{sign}{mantissa}e{exp}")
            };
        }
        let suffix = match exp {
            -9 => "n",
            -6 => "u",
            -3 => "m",
            0 => "",
            3 => "k",
            6 => "M",
            9 => "G",
            12 => "T",
            15 => "P",
            _ => "E",
        };
        write!(f, "{sign}{mantissa}{suffix}")
    }
}

impl serde::Serialize for Quantity {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Quantity {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Quantity;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a Kubernetes quantity")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Quantity, E> {
                Quantity::parse(v).map_err(E::custom)
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Quantity, E> {
                Ok(Quantity::from_units(v))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Quantity, E> {
                i64::try_from(v)
                    .map(Quantity::from_units)
                    .map_err(E::custom)
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Quantity, E> {
                Quantity::parse(&v.to_string()).map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

impl From<&k8s_openapi::apimachinery::pkg::api::resource::Quantity> for Quantity {
    /// Lossy only for invalid input, which maps to zero; use [`parse_k8s`] to get the error.
    fn from(q: &k8s_openapi::apimachinery::pkg::api::resource::Quantity) -> Self {
        Quantity::parse(&q.0).unwrap_or(Quantity::ZERO)
    }
}

/// Parses a k8s-openapi quantity, reporting bad input.
pub fn parse_k8s(
    q: &k8s_openapi::apimachinery::pkg::api::resource::Quantity,
) -> Result<Quantity, QuantityError> {
    Quantity::parse(&q.0)
}

impl From<Quantity> for k8s_openapi::apimachinery::pkg::api::resource::Quantity {
    fn from(q: Quantity) -> Self {
        k8s_openapi::apimachinery::pkg::api::resource::Quantity(q.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(s: &str) -> Quantity {
        Quantity::parse(s).unwrap()
    }

    #[test]
    fn parses_and_compares() {
        assert_eq!(q("1Gi"), q("1024Mi"));
        assert_eq!(q("1k"), q("1000"));
        assert_eq!(q("1e3"), q("1k"));
        assert_eq!(q("500m"), q("0.5"));
        assert_eq!(q("1.5Gi").nanos(), 1_610_612_736 * NANO);
        assert!(q("40Gi") > q("39Gi"));
        assert!(q("-1") < q("0"));
        assert_eq!(q("100n").nanos(), 100);
        assert_eq!(q("1.5n").nanos(), 2, "below nano rounds up");
        assert_eq!(q(".5").nanos(), NANO / 2);
        assert_eq!(q("5.").nanos(), 5 * NANO);
    }

    #[test]
    fn rejects_garbage() {
        for bad in ["", "Gi", "1.2.3", "1X", "1Gii", "abc", "1e", "1e99", "--1"] {
            assert!(Quantity::parse(bad).is_err(), "{bad} should fail");
        }
        assert!(matches!(
            Quantity::parse("999999999999999999999999999999999"),
            Err(QuantityError::OutOfRange(_))
        ));
    }

    #[test]
    fn canonical_strings() {
        for (input, want) in [
            ("1Gi", "1Gi"),
            ("1024Mi", "1Gi"),
            ("1.5Gi", "1536Mi"),
            ("0.5", "500m"),
            ("1000", "1k"),
            ("1500", "1500"),
            ("12000", "12k"),
            ("80Gi", "80Gi"),
            ("0", "0"),
            ("100m", "100m"),
            ("1e3", "1e3"),
            ("1500e-3", "1500e-3"),
            ("10", "10"),
            ("1000Ki", "1000Ki"),
            ("512", "512"),
            ("0.5Ki", "512"),
        ] {
            assert_eq!(q(input).to_string(), want, "canonical form of {input}");
        }
    }

    #[test]
    fn arithmetic_and_division() {
        assert_eq!(q("1Gi").checked_add(q("1Gi")).unwrap().to_string(), "2Gi");
        assert_eq!(q("10").fits(&q("3")), 3);
        assert_eq!(q("0").fits(&q("3")), 0);
        assert_eq!(q("4").fits(&q("0")), i64::MAX);
        assert_eq!(q("1500m").milli_ceil(), 1500);
        assert_eq!(q("1500m").units_ceil(), 2);
        assert_eq!(q("3").as_i64(), Some(3));
        assert_eq!(q("3.5").as_i64(), None);
    }

    proptest::proptest! {
        #[test]
        fn canonical_string_round_trips(units in -1_000_000_000i64..1_000_000_000, milli in 0i64..1000, bin in proptest::bool::ANY) {
            let base = Quantity::from_nanos(i128::from(units) * NANO + i128::from(milli) * 1_000_000,
                if bin { Format::BinarySi } else { Format::DecimalSi });
            let again = Quantity::parse(&base.to_string()).unwrap();
            proptest::prop_assert_eq!(base, again);
        }

        #[test]
        fn parse_never_panics(s in "\\PC{0,24}") {
            let _ = Quantity::parse(&s);
        }
    }
}
