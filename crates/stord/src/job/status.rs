//! QEMU's job state machine: the states a job goes through ([`JobStatus`], each change
//! announced as JOB_STATUS_CHANGE) and the verbs a client sends, each accepted only in
//! the states QEMU's JobVerbTable lists for it ([`Verb`]).

/// QEMU's JobStatus.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobStatus {
    Created,
    Running,
    Paused,
    Ready,
    Standby,
    Waiting,
    Pending,
    Aborting,
    Concluded,
    Null,
}

impl JobStatus {
    /// As QMP names it.
    pub fn name(self) -> &'static str {
        match self {
            JobStatus::Created => "created",
            JobStatus::Running => "running",
            JobStatus::Paused => "paused",
            JobStatus::Ready => "ready",
            JobStatus::Standby => "standby",
            JobStatus::Waiting => "waiting",
            JobStatus::Pending => "pending",
            JobStatus::Aborting => "aborting",
            JobStatus::Concluded => "concluded",
            JobStatus::Null => "null",
        }
    }
}

/// QEMU's JobVerb, with the states that accept each (its JobVerbTable).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verb {
    Cancel,
    Pause,
    Resume,
    SetSpeed,
    Complete,
    Finalize,
    Dismiss,
    Change,
}

impl Verb {
    pub(super) fn name(self) -> &'static str {
        match self {
            Verb::Cancel => "cancel",
            Verb::Pause => "pause",
            Verb::Resume => "resume",
            Verb::SetSpeed => "set-speed",
            Verb::Complete => "complete",
            Verb::Finalize => "finalize",
            Verb::Dismiss => "dismiss",
            Verb::Change => "change",
        }
    }

    pub(super) fn allowed(self, s: JobStatus) -> bool {
        use JobStatus::*;
        match self {
            Verb::Cancel => matches!(
                s,
                Created | Running | Paused | Ready | Standby | Waiting | Pending
            ),
            Verb::Pause | Verb::Resume | Verb::SetSpeed | Verb::Change => {
                matches!(s, Created | Running | Paused | Ready | Standby)
            }
            Verb::Complete => s == Ready,
            Verb::Finalize => s == Pending,
            Verb::Dismiss => s == Concluded,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verbs_follow_qemus_table() {
        use JobStatus::*;
        assert!(Verb::Complete.allowed(Ready) && !Verb::Complete.allowed(Running));
        assert!(Verb::Cancel.allowed(Pending) && !Verb::Cancel.allowed(Concluded));
        assert!(Verb::Pause.allowed(Standby) && !Verb::Pause.allowed(Waiting));
        assert!(Verb::Dismiss.allowed(Concluded) && !Verb::Dismiss.allowed(Aborting));
    }
}
