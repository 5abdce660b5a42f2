//! The rates of a model's EXL3 projections by name (synthetic weights for benchmarks).

use super::{Bitrate, Codebook};

/// The projections of a decoder layer, as [`Exl3Rates`] names them.
pub const PROJECTIONS: [&str; 7] = ["q", "k", "v", "o", "gate", "up", "down"];

/// The rates of a model's EXL3 projections, as `bench --exl3 CODEBOOK:BITS[,PROJ=BITS...]` makes
/// synthetic weights of them: one codebook, a bitrate, and other bitrates for some projections
/// (as a quantizer's allocation leaves them: k, v, up a bit above the rest).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Exl3Rates {
    pub codebook: Codebook,
    pub rate: Bitrate,
    /// The rates of [`PROJECTIONS`] that are not `rate`.
    pub other: [Option<Bitrate>; PROJECTIONS.len()],
}

impl Exl3Rates {
    pub fn uniform(codebook: Codebook, rate: Bitrate) -> Exl3Rates {
        Exl3Rates {
            codebook,
            rate,
            other: [None; PROJECTIONS.len()],
        }
    }

    /// `mul1:3` or `mul1:3,k=4,v=4,up=4`: bits 1..8 or the half rates 1.5 / 2.5 / 3.5.
    pub fn parse(s: &str) -> Result<Exl3Rates, String> {
        let mut items = s.split(',');
        let first = items.next().unwrap_or_default();
        let (cb, bits) = first
            .split_once(':')
            .ok_or_else(|| format!("'{s}': expected CODEBOOK:BITS, e.g. mul1:3 or mul1:3,up=4"))?;
        let codebook = Codebook::from_name(cb)
            .ok_or_else(|| format!("unknown codebook '{cb}' (mul1, mcg, 3inst)"))?;
        let rate = |bits: &str| -> Result<Bitrate, String> {
            let bad = || format!("'{bits}' bits: 1..8 or 1.5, 2.5, 3.5");
            let b: f32 = bits.parse().map_err(|_| bad())?;
            let twice = b * 2.0;
            if !(1.0..=16.0).contains(&twice) || twice.fract() != 0.0 {
                return Err(bad());
            }
            Bitrate::from_tile_words(8 * twice as usize).map_err(|_| bad())
        };
        let mut spec = Exl3Rates::uniform(codebook, rate(bits)?);
        for item in items {
            let (proj, bits) = item
                .split_once('=')
                .ok_or_else(|| format!("'{item}': expected PROJECTION=BITS, e.g. up=4"))?;
            let i = PROJECTIONS.iter().position(|&p| p == proj).ok_or_else(|| {
                format!("unknown projection '{proj}' ({})", PROJECTIONS.join(", "))
            })?;
            spec.other[i] = Some(rate(bits)?);
        }
        Ok(spec)
    }

    /// The rate of a projection of [`PROJECTIONS`].
    pub fn rate_of(&self, projection: &str) -> Bitrate {
        PROJECTIONS
            .iter()
            .position(|&p| p == projection)
            .and_then(|i| self.other[i])
            .unwrap_or(self.rate)
    }

    /// As reports name the weights: `exl3 Mul1 3 bits, up 4`.
    pub fn describe(&self) -> String {
        let mut s = format!("exl3 {:?} {} bits", self.codebook, self.rate.bits());
        for (p, r) in PROJECTIONS.iter().zip(&self.other) {
            if let Some(r) = r {
                s += &format!(", {p} {}", r.bits());
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_rate_and_other_rates_by_projection() {
        let r = Exl3Rates::parse("mul1:3,k=4,v=4,up=2.5").unwrap();
        assert_eq!(r.codebook, Codebook::Mul1);
        assert_eq!(r.rate, Bitrate::int(3));
        assert_eq!(r.rate_of("q"), Bitrate::int(3));
        assert_eq!(r.rate_of("k"), Bitrate::int(4));
        assert_eq!(r.rate_of("up"), Bitrate::half(2));
        assert_eq!(r.rate_of("down"), Bitrate::int(3));
        assert_eq!(r.describe(), "exl3 Mul1 3 bits, k 4, v 4, up 2.5");
        assert_eq!(
            Exl3Rates::parse("mcg:2").unwrap(),
            Exl3Rates::uniform(Codebook::Mcg, Bitrate::int(2))
        );
        for bad in [
            "mul1",
            "mul9:3",
            "mul1:9",
            "mul1:2.25",
            "mul1:3,x=4",
            "mul1:3,up",
            "mul1:3,up=0",
        ] {
            assert!(Exl3Rates::parse(bad).is_err(), "{bad} parsed");
        }
    }
}
